"""The workload people run most: a folder of JPEG files, decoded and augmented per sample.

Each sample is read from its file, decoded with PIL, cropped and resized as torchvision's
``RandomResizedCrop(224)`` does (scale 0.08-1, ratio 3/4-4/3, bilinear), flipped with
probability 1/2, and made a 3x224x224 uint8 tensor with its label; batches are the default
collation (a dict of stacked tensors). Every loader runs the same dataset object with 2 worker
processes, in file order, at batch 32 and 256:

- torch's ``DataLoader`` (``persistent_workers=True``, its default ``fork`` start method);
- aioloader's ``DataLoader`` (its defaults: ``forkserver`` workers, shared-memory batches);
- ``torchdata.nodes`` (``ParallelMapper`` over 2 forkserver processes making a batch each) and
  SPDL (a ``pipe`` stage on a 2-process ``ProcessPoolExecutor``), where installed (see
  ``other_loaders.py``; ``pip install 'aioloader[bench]'``); a row says when one is not.

Each loader runs in a fresh interpreter: ``cold`` is the first epoch's images/s counted from
the loader's construction (workers starting included), ``warm`` the best later epoch's; ``CPU
ms/img`` is the CPU time of the whole process tree (this process, the worker server, the
workers) per image over the warm epochs; ``peak PSS`` the largest sum of PSS over the tree
(``bench_loader.PeakPss``). The machine's ceiling for this pipeline is measured in the same run:
one process decoding alone (no loader, no collation), times the CPUs this process may use. On
two cores the decode is the bound, so each loader's rate is also shown as a share of it.

The folder is made once (photo-like content: smooth colour fields with grain, 400-640 x 300-480
px, ~100 KB at quality 90) under ``--cache`` (default ``~/.cache/aioloader-bench``).

    python benchmarks/jpeg_pipeline.py                      # 4,096 files, ~4 minutes on 2 cores
    python benchmarks/jpeg_pipeline.py --files 4096 --epochs 3
    python benchmarks/jpeg_pipeline.py --quick              # the smoke test: tiny, seconds
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

LOADERS = ("torch", "aioloader", "torchdata", "spdl")
MODULES = {"torchdata": "torchdata.nodes", "spdl": "spdl.pipeline"}
WORKERS = 2
CROP = 224
#: Bump when the files' content changes: a folder made by an older version is not reused.
FOLDER_VERSION = 1


# -- the folder -------------------------------------------------------------------------------


def make_image(index: int) -> bytes:
    """File ``index``'s JPEG bytes: a smooth random colour field (a few blobs, bicubic-upscaled
    from a tiny grid) with grain, the statistics of a photo rather than of noise."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(index)
    w, h = int(rng.integers(400, 641)), int(rng.integers(300, 481))
    grid = rng.integers(0, 256, size=(int(rng.integers(4, 12)), int(rng.integers(4, 12)), 3))
    smooth = Image.fromarray(grid.astype(np.uint8)).resize((w, h), Image.Resampling.BICUBIC)
    pixels = np.asarray(smooth).astype(np.int16) + rng.normal(0, 14, (h, w, 3)).astype(np.int16)
    out = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(out, "JPEG", quality=90)
    return out.getvalue()


def _write(job: tuple[str, int]) -> int:
    folder, index = job
    data = make_image(index)
    path = Path(folder) / f"{index:06d}.jpg"
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.rename(path)  # a file is whole or absent, if the run is interrupted
    return len(data)


def ensure_folder(cache: Path, files: int) -> list[str]:
    """The paths of the ``files`` JPEG files, made now where missing."""
    folder = cache / f"jpeg-v{FOLDER_VERSION}"
    folder.mkdir(parents=True, exist_ok=True)
    missing = [i for i in range(files) if not (folder / f"{i:06d}.jpg").exists()]
    if missing:
        import multiprocessing

        print(f"jpeg: making {len(missing)} JPEG files in {folder} ...", file=sys.stderr)
        with multiprocessing.get_context("spawn").Pool(os.cpu_count() or 1) as pool:
            pool.map(_write, [(str(folder), i) for i in missing], chunksize=16)
    return [str(folder / f"{i:06d}.jpg") for i in range(files)]


# -- the pipeline -----------------------------------------------------------------------------


def crop_box(width: int, height: int, rng: random.Random) -> tuple[int, int, int, int]:
    """torchvision's ``RandomResizedCrop.get_params`` (scale 0.08-1, ratio 3/4-4/3): ten tries
    at a random area and aspect, then the centre crop of the clamped aspect."""
    area = width * height
    log_ratio = (math.log(3 / 4), math.log(4 / 3))
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            x, y = rng.randint(0, width - w), rng.randint(0, height - h)
            return x, y, x + w, y + h
    ratio = width / height
    if ratio < 3 / 4:
        w, h = width, round(width / (3 / 4))
    elif ratio > 4 / 3:
        w, h = round(height * (4 / 3)), height
    else:
        w, h = width, height
    x, y = (width - w) // 2, (height - h) // 2
    return x, y, x + w, y + h


def load_sample(path: str, rng: random.Random) -> Any:
    """Read, decode, RandomResizedCrop(224), flip: a 3x224x224 uint8 tensor."""
    import numpy as np
    import torch
    from PIL import Image

    with open(path, "rb") as f:
        data = f.read()
    image = Image.open(io.BytesIO(data)).convert("RGB")
    image = image.resize((CROP, CROP), Image.Resampling.BILINEAR, box=crop_box(*image.size, rng))
    if rng.random() < 0.5:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return torch.from_numpy(np.array(image)).permute(2, 0, 1)  # a copy: writable


class JpegFolder:
    """The map-style dataset every loader reads: ``{"image": uint8 CHW, "label": int}``."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> dict[str, Any]:
        rng = random.Random()  # seeded from the OS: crops differ per epoch, as in training
        return {"image": load_sample(self.paths[index], rng), "label": index % 1000}


class BatchOf:
    """``indices -> default_collate([dataset[i] for i in indices])``: the function the peers'
    worker processes run for a batch (a batch per job, as torch's workers do)."""

    def __init__(self, dataset: JpegFolder) -> None:
        self.dataset = dataset

    def __call__(self, indices: list[int]) -> Any:
        from torch.utils.data import default_collate

        return default_collate([self.dataset[i] for i in indices])


def batches_of(n: int, batch: int) -> list[list[int]]:
    return [list(range(i, min(i + batch, n))) for i in range(0, n, batch)]


# -- the loaders (each in its own interpreter) ------------------------------------------------


def epochs_torch(dataset: JpegFolder, batch: int) -> tuple[Callable[[], Iterable[Any]], Any]:
    from torch.utils.data import DataLoader

    loader = DataLoader(dataset, batch_size=batch, num_workers=WORKERS, persistent_workers=True)
    return (lambda: loader), None


def epochs_aioloader(dataset: JpegFolder, batch: int) -> tuple[Callable[[], Iterable[Any]], Any]:
    import aioloader

    loader = aioloader.DataLoader(dataset, batch_size=batch, num_workers=WORKERS)
    return (lambda: loader), loader


def epochs_torchdata(dataset: JpegFolder, batch: int) -> tuple[Callable[[], Iterable[Any]], Any]:
    from torch.utils.data import SequentialSampler
    from torchdata.nodes import Batcher, Loader, ParallelMapper, SamplerWrapper

    node: Any = Batcher(SamplerWrapper(SequentialSampler(range(len(dataset)))), batch, False)
    node = ParallelMapper(
        node,
        BatchOf(dataset),
        num_workers=WORKERS,
        in_order=True,
        method="process",
        multiprocessing_context="forkserver",
    )
    loader = Loader(node)
    return (lambda: loader), None


def epochs_spdl(dataset: JpegFolder, batch: int) -> tuple[Callable[[], Iterable[Any]], Any]:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from spdl.pipeline import PipelineBuilder

    fetch = BatchOf(dataset)
    executor = ProcessPoolExecutor(WORKERS, mp_context=multiprocessing.get_context("forkserver"))

    def epoch() -> Iterator[Any]:
        pipeline = (
            PipelineBuilder()
            .add_source(batches_of(len(dataset), batch))
            .pipe(fetch, concurrency=2 * WORKERS, executor=executor, output_order="input")
            .add_sink(2 * WORKERS)
            .build(num_threads=1)
        )
        with pipeline.auto_stop():
            yield from pipeline.get_iterator(timeout=600)

    class Closer:
        def close(self) -> None:
            executor.shutdown()

    return epoch, Closer()


EPOCHS: dict[str, Callable[[JpegFolder, int], tuple[Callable[[], Iterable[Any]], Any]]] = {
    "torch": epochs_torch,
    "aioloader": epochs_aioloader,
    "torchdata": epochs_torchdata,
    "spdl": epochs_spdl,
}


def tree_cpu_s() -> float:
    """CPU seconds of this process and every descendant, reaped children included."""
    from aioloader._stats._counters import process_tree_cpu

    read = process_tree_cpu()
    return read[1] if read is not None else float("nan")


def child(loader: str, paths: list[str], batch: int, epochs: int) -> dict[str, Any]:
    """One loader's run: the first epoch from construction, then ``epochs - 1`` warm ones."""
    import bench_loader
    import torch

    torch.set_num_threads(1)
    dataset = JpegFolder(paths)
    images = len(dataset)
    result: dict[str, Any] = {"loader": loader, "batch": batch, "images": images}
    with bench_loader.PeakPss() as memory:
        started, cpu0 = time.perf_counter(), tree_cpu_s()
        epoch, closer = EPOCHS[loader](dataset, batch)
        seen = sum(len(b["label"]) for b in epoch())
        cold_s = time.perf_counter() - started
        assert seen == images, (loader, seen, images)
        cpu1 = tree_cpu_s()
        warm: list[float] = []
        for _ in range(epochs - 1):
            t = time.perf_counter()
            seen = sum(len(b["label"]) for b in epoch())
            warm.append(images / (time.perf_counter() - t))
            assert seen == images
        cpu2 = tree_cpu_s()
        if loader == "aioloader":
            stats = closer.statistics().epoch_stats
            result["verdict"] = f"{stats.bottleneck}: {stats.knob or 'no knob'}"
            result["hint"] = stats.hint
        memory.sample()  # the workers and the batches' memory, before they go
        if closer is not None:
            closer.close()
    result["pss_samples"] = memory.samples
    result["cold_img_s"] = images / cold_s
    result["warm_img_s"] = max(warm) if warm else None
    result["cold_cpu_ms"] = (cpu1 - cpu0) / images * 1e3
    result["warm_cpu_ms"] = (cpu2 - cpu1) / (images * len(warm)) * 1e3 if warm else None
    result["peak_pss_mb"] = memory.peak / 2**20
    return result


def decode_for(paths: list[str], seconds: float, first: int = 0) -> tuple[float, float]:
    """Decode samples one after another for ``seconds`` (at least 16): (images/s, CPU ms
    per image) of the calling process."""
    rng = random.Random(first)
    load_sample(paths[first % len(paths)], rng)  # imports and first-call costs off the clock
    done, started, cpu = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - started < seconds or done < 16:
        load_sample(paths[(first + done) % len(paths)], rng)
        done += 1
    return done / (time.perf_counter() - started), (time.process_time() - cpu) / done * 1e3


def ceiling(paths: list[str], seconds: float) -> dict[str, Any]:
    """Images/s of this one process decoding alone, and that times the CPUs it may use; and
    what as many processes as CPUs decoding at once make together (no loader, no collation,
    nothing sent anywhere): the most these cores give this pipeline as they are shared now."""
    import concurrent.futures
    import multiprocessing

    from aioloader._stats._counters import cpus_available

    rate, cpu_ms = decode_for(paths, seconds)
    cpus = cpus_available()
    n = max(1, math.floor(cpus))
    context = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(n, mp_context=context) as pool:
        parts = list(pool.map(decode_for, [paths] * n, [seconds] * n, range(0, 97 * n, 97)))
    return {
        "one_process_img_s": rate,
        "one_process_cpu_ms": cpu_ms,
        "cpus": cpus,
        "ceiling_img_s": rate * cpus,
        "all_cores_img_s": sum(r for r, _ in parts),
        "all_cores_cpu_ms": sum(c for _, c in parts) / n,
        # What the cores could do if this pipeline had them to itself (on a shared machine the
        # measured rate is lower: other processes take part of each core).
        "cpu_ceiling_img_s": cpus / cpu_ms * 1e3,
    }


def run_child(argv: list[str], timeout: float) -> dict[str, Any]:
    import harness

    document: dict[str, Any] = harness.run_child(__file__, argv, f"jpeg: {' '.join(argv)}", timeout)
    return document


def installed(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=4096, help="JPEG files (default 4096)")
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--epochs", type=int, default=2, help="epochs per loader (>= 2)")
    parser.add_argument("--loaders", default=",".join(LOADERS))
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "aioloader-bench")
    parser.add_argument(
        "--ceiling-s",
        type=float,
        default=4.0,
        help="seconds of decoding alone (and on every core) per ceiling measure (default 4; "
        "--quick: 1)",
    )
    parser.add_argument("--quick", action="store_true", help="the smoke test: 64 files, batch 16")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    parser.add_argument("--child", nargs=2, metavar=("LOADER", "BATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.files, args.batch, args.epochs = 64, [16], 2
    if args.files < 1 or args.epochs < 2:
        parser.error(f"--files must be >= 1 and --epochs >= 2, got {args.files}, {args.epochs}")
    if not args.ceiling_s > 0:
        parser.error(f"--ceiling-s must be > 0, got {args.ceiling_s}")
    paths = ensure_folder(args.cache, args.files)
    if args.child:
        name, batch = args.child
        if name == "ceiling":
            print(json.dumps(ceiling(paths, float(batch))))
        else:
            print(json.dumps(child(name, paths, int(batch), args.epochs)))
        return 0

    common = ["--files", str(args.files), "--epochs", str(args.epochs), "--cache", str(args.cache)]
    chosen = [n for n in args.loaders.split(",") if n]
    unknown = set(chosen) - set(LOADERS)
    if unknown:
        parser.error(f"--loaders: unknown {sorted(unknown)}; known: {', '.join(LOADERS)}")
    skipped = {
        n: f"not installed (pip install {n})"
        for n in chosen
        if n in MODULES and not installed(MODULES[n])
    }
    ceil_s = str(args.ceiling_s) if not args.quick or "--ceiling-s" in (argv or sys.argv) else "1"
    before = run_child([*common, "--child", "ceiling", ceil_s], 120)
    rows: list[dict[str, Any]] = []
    for batch in args.batch:
        for name in chosen:
            if name in skipped:
                continue
            print(f"jpeg: {name}, batch {batch} ...", file=sys.stderr, flush=True)
            rows.append(run_child([*common, "--child", name, str(batch)], 900))
    after = run_child([*common, "--child", "ceiling", ceil_s], 120)
    # The ceiling: the mean of a measure before and after the loaders (the machine is shared).
    top = (before["ceiling_img_s"] + after["ceiling_img_s"]) / 2
    together = (before["all_cores_img_s"] + after["all_cores_img_s"]) / 2
    document = {
        "benchmark": "jpeg",
        "files": args.files,
        "epochs": args.epochs,
        "workers": WORKERS,
        "ceiling_img_s": top,
        "all_cores_img_s": together,
        "ceiling": [before, after],
        "skipped": skipped,
        "rows": rows,
    }
    print(table(document), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(document))
    return 0


def table(doc: dict[str, Any]) -> str:
    """A markdown table: a row per loader and batch size, ratios to torch and to the ceiling."""
    top = doc["ceiling_img_s"]
    together = doc["all_cores_img_s"]
    alone = [c.get("one_process_cpu_ms", float("nan")) for c in doc["ceiling"]]
    apart = [c.get("all_cores_cpu_ms", float("nan")) for c in doc["ceiling"]]
    cpus = doc["ceiling"][0]["cpus"]
    lines = [
        f"JPEG folder: {doc['files']} files, {doc['workers']} workers; ceiling {top:.0f} img/s "
        f"({cpus:g} CPUs x one process decoding alone, mean of before and after; decoding "
        f"alone costs {sum(alone) / len(alone):.2f} CPU ms/img). {math.floor(cpus)} processes "
        f"decoding at once made {together:.0f} img/s together ({together / top:.2f} of the "
        f"ceiling, {sum(apart) / len(apart):.2f} CPU ms/img each): the *all cores* column.",
        "",
        "| batch | loader | cold img/s | warm img/s | warm / torch | warm / ceiling "
        "| cold / ceiling | warm / all cores | CPU ms/img (warm) | peak PSS MB | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    torch_warm = {r["batch"]: r["warm_img_s"] for r in doc["rows"] if r["loader"] == "torch"}
    for r in doc["rows"]:
        base = torch_warm.get(r["batch"])
        ratio = f"{r['warm_img_s'] / base:.2f}x" if base else ""
        lines.append(
            f"| {r['batch']} | {r['loader']} | {r['cold_img_s']:.0f} | {r['warm_img_s']:.0f} "
            f"| {ratio} | {r['warm_img_s'] / top:.2f} | {r['cold_img_s'] / top:.2f} "
            f"| {r['warm_img_s'] / together:.2f} "
            f"| {r['warm_cpu_ms']:.2f} | {r['peak_pss_mb']:.0f} | {r.get('verdict', '')} |"
        )
    for name, why in doc["skipped"].items():
        lines.append(f"| | {name} | {why} | | | | | | | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
