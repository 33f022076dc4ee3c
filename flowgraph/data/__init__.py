"""Datasets as tables, before any token becomes a tensor: what the data sources
(`flowgraph.nodes.data`) and `flowgraph check --data` (`flowgraph.checker.data`) both read.

* `readers`: a dataset's table, from a file, a built-in or a table held in memory.
* `rows`: the row checks (malformed cells, missing ground truth, empty pairs).
* `rendering`: prompts and responses as token ids; the rows over a length limit.
* `tasks`, `agent_tasks`: the built-in datasets (`builtin:arith`, `builtin:mul`, ...).
* `held`: DataFrames, `datasets` objects and hub datasets, held under a `memory:` key
  and written into the run dir as parquet files.

`held` and the tasks import nothing heavy (the graph builder and the structural checker
import `held`); `readers`, `rows` and `rendering` import pyarrow (and numpy), so they are
imported only by the data sources and `check --data`.
"""
