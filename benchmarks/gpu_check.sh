#!/usr/bin/env bash
# One bounded device check of the device stage, for a machine with a CUDA GPU.
#
#   benchmarks/gpu_check.sh [BASELINE_TREE]
#
# For this tree (and, if given, for BASELINE_TREE: a plain copy of the repository at another
# commit, e.g. made with `git archive <commit> | tar -x -C base` before the tree travels to
# the GPU machine), it runs, each step under its own timeout:
#   1. the `cuda`-marked tests (tests/test_device_cuda.py and every other test carrying the
#      marker), then every tests/test_device*.py, this tree only;
#   2. benchmarks/gpu_transfer.py at 4, 32 and 128 MB (--json);
#   3. examples/train_gpu.py, sized to finish in about a minute;
#   4. this tree only: gpu_transfer.py at 4 and 32 MB with --spin-events (events that spin
#      instead of blocking: the wake latency of the other choice of BLOCKING_EVENTS);
# then prints one summary: per batch size the stage's bandwidth over the plain pinned loop's
# from pageable, registered and pinned-collated memory, the share of the copy hidden behind a
# step, the wake latency and the staged bytes per batch; and train_gpu's GPU busy share.
# The whole check stays under 8 minutes on an H100 (the step timeouts add up to 7 min 40 s).
#
# Environment: PYTHON (default: .venv/bin/python if present, else python3); OUT (default: a
# fresh temporary directory) receives every log and JSON document.
set -u

HERE="$(cd "$(dirname "$0")/.." && pwd)"
BASE="${1:-}"
if [[ -n "$BASE" ]]; then
    BASE="$(cd "$BASE" && pwd)" || { echo "gpu_check: no baseline tree at $1" >&2; exit 2; }
fi
if [[ -n "${PYTHON:-}" ]]; then
    PY="$PYTHON"
elif [[ -x "$HERE/.venv/bin/python" ]]; then
    PY="$HERE/.venv/bin/python"
else
    PY="python3"
fi
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: torch sees no CUDA device here; nothing to measure (needs a GPU)."
    exit 0
fi
"$PY" -c 'import torch; print("gpu_check:", torch.cuda.get_device_name(0), "torch", torch.__version__)'

# Caps, not estimates: main 2 x 60 + 75 + 75 + 40, baseline 75 + 75 = 460 s at most.
TESTS_S=60
TRANSFER_S=75
TRAIN_S=75
SPIN_S=40

run_tree() {  # $1: label, $2: tree
    local label="$1" tree="$2"
    echo "== $label: $tree"
    (cd "$tree" && PYTHONPATH="$tree" timeout "$TRANSFER_S" "$PY" benchmarks/gpu_transfer.py \
        --batch-mb 4 32 128 --batches 20 --json >"$OUT/$label.transfer.json" \
        2>"$OUT/$label.transfer.txt")
    echo "   gpu_transfer: rc=$? ($OUT/$label.transfer.txt)"
    (cd "$tree" && PYTHONPATH="$tree" timeout "$TRAIN_S" "$PY" examples/train_gpu.py \
        --samples 8192 --epochs 2 >"$OUT/$label.train.txt" 2>&1)
    echo "   train_gpu: rc=$? ($OUT/$label.train.txt)"
}

echo "== main: cuda tests"
# The modules that carry the marker (collecting the whole suite would import what only some
# of its tests need), then every device test: the fake-CUDA ones run here too, in seconds.
CUDA_FILES="$(cd "$HERE" && grep -l 'mark.cuda' tests/test_*.py | tr '\n' ' ')"
(cd "$HERE" && PYTHONPATH="$HERE" timeout "$TESTS_S" "$PY" -m pytest -n 0 -p no:cacheprovider \
    -q -m cuda $CUDA_FILES >"$OUT/main.tests.txt" 2>&1 \
    && PYTHONPATH="$HERE" timeout "$TESTS_S" "$PY" -m pytest -n 0 -p no:cacheprovider -q \
    tests/test_device*.py >>"$OUT/main.tests.txt" 2>&1)
echo "   cuda tests, then device tests: rc=$? $(tail -n 1 "$OUT/main.tests.txt")"
run_tree main "$HERE"
(cd "$HERE" && PYTHONPATH="$HERE" timeout "$SPIN_S" "$PY" benchmarks/gpu_transfer.py \
    --batch-mb 4 32 --batches 20 --spin-events --json >"$OUT/main-spin.transfer.json" \
    2>"$OUT/main-spin.transfer.txt")
echo "   gpu_transfer --spin-events: rc=$? ($OUT/main-spin.transfer.txt)"
if [[ -n "$BASE" ]]; then
    run_tree baseline "$BASE"
fi

"$PY" - "$OUT" <<'PY'
import json
import re
import sys
from pathlib import Path

out = Path(sys.argv[1])


def transfer(label):
    path = out / f"{label}.transfer.json"
    try:
        return json.loads(path.read_text().strip().splitlines()[-1])
    except (OSError, ValueError, IndexError):
        return None


def train(label):
    path = out / f"{label}.train.txt"
    return path.read_text() if path.exists() else ""


print("\n== summary (ratios are of the plain pinned .to() loop's GB/s, same run)")
for label in ("baseline", "main", "main-spin"):
    doc = transfer(label)
    text = train(label)
    if doc is None and not text:
        continue
    print(f"-- {label}")
    for r in (doc or {}).get("rows", []):
        pinned = r["pinned_to_gbps"] or float("nan")
        c = r.get("counters", {})
        wake = c.get("registered", {})
        line = (
            f"  {r['batch_mb']:>5g} MB: pageable {r['stage_gbps'] / pinned:4.0%}"
            f"  registered {r['stage_registered_gbps'] / pinned:4.0%}"
        )
        if "stage_pinned_collation_gbps" in r:
            line += f"  pinned-collated {r['stage_pinned_collation_gbps'] / pinned:4.0%}"
        line += (
            f"  (pinned .to {r['pinned_to_gbps']:.1f} GB/s)"
            f"  hidden {r['hidden']:.0%} / reg {r['registered_hidden']:.0%}"
            f"  lag p99 {r['loop_lag_p99_ms']:.2f} / {r['registered_loop_lag_p99_ms']:.2f} ms"
        )
        if wake:
            if "handoff_p50_us" in wake:  # this tree: hand-off, and the wake end to end
                line += (
                    f"  hand-off p50/p99 {wake['handoff_p50_us']:.0f}/"
                    f"{wake['handoff_p99_us']:.0f} us"
                )
            line += (
                f"  wake p50/p99 {wake['wake_p50_us']:.0f}/{wake['wake_p99_us']:.0f} us"
                f"  staged B/batch pageable {c['pageable']['staged_bytes_per_batch']:.0f}"
                f" reg {wake['staged_bytes_per_batch']:.0f}"
                f" pinned {c['pinned_collation']['staged_bytes_per_batch']:.0f}"
            )
        print(line)
    if doc is not None and "skipped" in doc:
        print(f"  gpu_transfer skipped: {doc['skipped']}")
    busy = re.findall(r"GPU busy (\d+)%", text)
    verdict = [line for line in text.splitlines() if line.startswith("loader: ")]
    device = [line.strip() for line in text.splitlines() if line.startswith("  device stage")]
    print(f"  train_gpu: GPU busy per epoch {', '.join(b + '%' for b in busy) or 'n/a'}")
    if device:
        print(f"  {device[-1]}")
    if verdict:
        print(f"  {verdict[-1]}")
tests = out / "main.tests.txt"
if tests.exists():
    lines = tests.read_text().strip().splitlines()
    print(f"-- cuda tests (main): {lines[-1] if lines else 'no output'}")
print(f"logs: {out}")
PY
