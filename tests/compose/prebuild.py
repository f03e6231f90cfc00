"""Build the compose test's images ahead of the test: `scripts/test` runs this in the background (niced) while the
rest of the suite runs, so that a cold image cache (about 14 minutes on 2 cores) is paid while the suite's
engines are busy anyway, and the compose test then finds its images built.

The compose fixture builds the same images the same way (tests/compose/stack.py: build_images) and skips every image
whose inputs are unchanged, so this is only a head start: if it fails, the test builds again and shows the error.

    python -m tests.compose.prebuild          # exit 0: built, or nothing to do here (podman cannot run: says why)
"""

from __future__ import annotations

import sys

from tests.compose.podman import Podman, cannot_run_reason
from tests.compose.stack import Timings, build_images, cache_dir


def main() -> int:
    reason = cannot_run_reason()
    if reason:
        print(f"compose prebuild: nothing built: {reason}", flush=True)
        return 0
    cache = cache_dir()
    timings = Timings()
    build_images(Podman(cache / "podman"), cache, timings)  # builds need no API service
    print("compose prebuild: done: " + ", ".join(f"{k} {v}s" for k, v in timings.phases.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
