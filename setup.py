"""The one compiled part: app/engine/kvdecode.c, the CPU path's attention over the
packed KV cache (app/engine/kvcpu.py). Optional: where it cannot be built (no C
compiler), the install goes on and kvcpu uses its numpy code instead."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "app.engine._kvdecode",
            sources=["app/engine/kvdecode.c"],
            # -Wno-psabi: kvdecode.c's vector helpers are always inlined, so GCC's
            # notes that passing them to an AVX2 clone changes the ABI do not apply.
            extra_compile_args=["-O3", "-Wno-psabi"],
            optional=True,
        )
    ]
)
