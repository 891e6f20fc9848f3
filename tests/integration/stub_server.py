"""``python -m stub_server ARGS``: ``python -m jaxserve.serve ARGS`` with stub_engine's
StubEngineCore (no JAX, starts in seconds) in place of EngineCore, for the server failure and
reliability tests (``Server(..., module="stub_server")``; this folder on PYTHONPATH).

The engine process is a ``spawn`` child, which imports this module again (as ``__mp_main__``)
before it runs ``run_engine_core``: the stand-in below is in place there too, so the engine's
``from jaxserve.engine.core import EngineCore`` gets the stub and JAX is never imported.
"""

import sys
import types

from stub_engine import StubEngineCore

_core = types.ModuleType("jaxserve.engine.core")
_core.EngineCore = StubEngineCore
sys.modules["jaxserve.engine.core"] = _core

if __name__ == "__main__":
    from jaxserve.serve import main

    sys.exit(main())
