"""The library behind train.py, eval.py, export.py, predict.py, convert_pth.py and benchmark.py.

Importing it does two things before MindSpore is imported (every entry point imports src first):
- it sets MindSpore's C++ log to errors only (GLOG_v=3) unless the user chose a level: MindSpore reads GLOG_v when it
  is imported. Without it MindSpore prints its own notices (deprecations of its APIs, a CPU communication
  default) among the project's log lines;
- it keeps triton out of the process. MindSpore imports triton wherever it is installed (torch installs it), only to
  let triton kernels take MindSpore tensors; this project runs none, and the import cost every process about 70 MB of
  memory and 60 ms. torch runs without it (on the CPU it uses none). A process that imported triton before src keeps
  it.
"""
import os
import sys

os.environ.setdefault("GLOG_v", "3")
sys.modules.setdefault("triton", None)  # None: `import triton` raises ImportError, which MindSpore expects
