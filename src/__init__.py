"""The library behind train.py, eval.py, export.py, predict.py, convert_pth.py and benchmark.py.

Importing it sets MindSpore's C++ log to errors only (GLOG_v=3) unless the user chose a level: MindSpore
reads GLOG_v when it is imported, and every entry point imports src before mindspore. Without it a
training step's compilation prints about 160 '[WARNING] ANALYZER ... side effect nodes' lines.
"""
import os

os.environ.setdefault("GLOG_v", "3")
