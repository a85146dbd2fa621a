"""`fusegraph bench`: the benchmark driver (issue 25), in the manner of MIOpenDriver and
Fusilli's benchmark driver.

flags.py parses driver command lines (MIOpenDriver's flag meanings), cases.py builds a
fusegraph graph (and its PyTorch / ONNX forms) per family, baselines.py makes what a user
would otherwise call (PyTorch eager, torch.compile, cuDNN's frontend, ONNX Runtime),
runner.py times everything through select/timing.py and checks it against the float64
reference, report.py writes the table, CSV, JSON and chart. docs/bench.md is the guide.
"""
