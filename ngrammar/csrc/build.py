"""Build the row-invariant CPU kernels (``ngrammar._cpu_kernels``) in place: ``make setup`` runs
``python ngrammar/csrc/build.py`` from the repository root, with gcc and the installed torch's
headers (no download)."""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = Path(__file__).resolve().parents[2]

# -march=native: the build machine's vector registers (built in place, where it runs); -ffp-contract=off:
# no fused multiply-adds, so every ISA rounds as the scalar code does.
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fopenmp"]


def main() -> None:
    setup(
        name="ngrammar-cpu-kernels",
        ext_modules=[
            CppExtension(
                "ngrammar._cpu_kernels",
                [str(Path("ngrammar") / "csrc" / name) for name in ("cpu_kernels.cpp", "quant_kernels.cpp")],
                extra_compile_args=FLAGS,
                extra_link_args=["-fopenmp"],
            )
        ],
        cmdclass={"build_ext": BuildExtension},
        script_args=[
            *sys.argv[1:],
            "build_ext",
            "--inplace",
            "--build-temp",
            str(Path("build") / "cpu_kernels"),
        ],
    )


if __name__ == "__main__":
    import os

    os.chdir(ROOT)
    main()
