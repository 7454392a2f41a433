"""Tools an agent calls between turns: a calculator, BM25 search over a local corpus, and a sandboxed Python
executor; plugins by import path, run in worker processes (process_tool.py) or inline. A tool's failure is its call's
output, never an exception (base.call_tool)."""
