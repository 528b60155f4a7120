"""Load generators and their statistics: offline.py drives an `LLM` (`sparse-framework bench`),
online.py an OpenAI-compatible server (`sparse-framework bench-serve`); stats.py holds the one
percentile every table and JSON uses; floors come from common/hardware.py."""
