"""Load generators and their statistics: offline.py drives an `LLM` (`sparse-framework bench`),
online.py an OpenAI-compatible server (`sparse-framework bench-serve`: the sweep and the command,
over serve_spec.py the options, serve_load.py the prompts and arrivals, serve_client.py the HTTP
requests, serve_report.py the figures and tables); stats.py holds the one percentile every table
and JSON uses; floors come from common/hardware.py."""
