"""The same script with the usual guard and a ``with`` block (what the docs advise): it must
still work, with every start method. An optional argument names the start method."""

import os
import sys

import aioloader

print(f"top level ran in {os.getpid()}", flush=True)


class Cubes:
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> int:
        return i**3


def main() -> None:
    method = sys.argv[1] if len(sys.argv) > 1 else None
    with aioloader.DataLoader(Cubes(), batch_size=4, num_workers=2, mp_context=method) as loader:
        for epoch in range(2):
            print(f"epoch {epoch}: {[batch.tolist() for batch in loader]}", flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main()
