"""The one compiled library: app/engine/kvdecode.c, the CPU path's attention over
the packed KV cache (app/engine/kvcpu.py), app/engine/short_turn.c, a short turn's
attention over float16 rows (app/engine/turn_attention.py), and
app/engine/packed_rows.c, its decode step's products through weights as stored
(app/engine/packed_rows.py). Optional: where it cannot be built (no C
compiler), the install goes on and they use numpy and BLAS instead."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "app.engine._kvdecode",
            sources=[
                "app/engine/kvdecode.c",
                "app/engine/packed_rows.c",
                "app/engine/short_turn.c",
            ],
            depends=["app/engine/vector8.h"],
            # -Wno-psabi: kvdecode.c's vector helpers are always inlined, so GCC's
            # notes that passing them to an AVX2 clone changes the ABI do not apply.
            extra_compile_args=["-O3", "-Wno-psabi"],
            optional=True,
        )
    ]
)
