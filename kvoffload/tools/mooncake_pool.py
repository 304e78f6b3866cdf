"""A long-lived contributor to a Mooncake pool: joins it with a memory segment and holds it until SIGTERM
or Ctrl-C, so that values outlive the engines that wrote them (the engines then open it with segment=0).

    python -m kvoffload.tools.mooncake_pool 'mooncake://10.0.0.5:50051?segment=64GiB'"""

from __future__ import annotations

import signal
import sys
import threading


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    from ..store.errors import StoreConfigError
    from ..store.mooncake_store import MooncakeStore

    try:
        store = MooncakeStore(args[0])
    except StoreConfigError as exc:
        print(f"kvoffload: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"contributing {store.spec.segment} bytes to the pool at {store.spec.master}", flush=True)
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
