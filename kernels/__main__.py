"""`python -m kernels`: build the C++ CPU kernels now (make install does), and say where."""

import logging

from kernels import cpu

logging.basicConfig(format="%(message)s")
print(cpu.build_directory() if cpu.available() else "not built: the torch reference kernels will run")
