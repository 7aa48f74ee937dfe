"""`python -m kvkernels`: build the C++ CPU kernels now (make install does), and say where."""

import logging

from kvkernels import cpu

logging.basicConfig(format="%(message)s")
print(cpu.build_directory() if cpu.available() else "not built: the torch reference kernels will run")
