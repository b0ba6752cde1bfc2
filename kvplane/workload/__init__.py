"""Workloads and their measures, shared by the simulator's discrete-event mode and the
benchmarks: traces of prompts built from deterministic token segments (``traces``), the
per-request results and run summaries (``results``), and plain-text prompts for the demo
(``text``). The Mooncake conversation trace ships in ``data/``."""
