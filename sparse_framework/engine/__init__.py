"""The serving engine (docs/engine.md): `LLM` and `SamplingParams` for offline generation,
`Engine` for step-by-step control; `loop.py` is the synthetic decode loop of `run`/`eval`."""

from .engine import Engine
from .engine_config import EngineConfig
from .llm import LLM
from .request_output import RequestOutput
from .sampling import SamplingParams

__all__ = ["LLM", "Engine", "EngineConfig", "RequestOutput", "SamplingParams"]
