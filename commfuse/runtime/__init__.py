"""Runtime support: loading generated modules, the Triton interpreter switch, symmetric memory."""
