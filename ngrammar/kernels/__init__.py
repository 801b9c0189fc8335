"""Custom GPU kernels. Importing this package needs no Triton; import the submodules on demand."""
