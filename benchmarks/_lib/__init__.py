"""What the benchmark scripts share, so that each times, compares and reports the same way.

    timing.py       device time: a CUDA graph of calls replayed between CUDA events (`time_calls`),
                    a decode step's boundaries on the GPU's timeline (`StepClock`), and the noise
                    of a median (`notch`): a ratio is printed only where two medians differ
    floors.py       the machine's ceilings: copy and read-only bandwidth (a kernel's read floor is
                    the bytes it must read over them) and bf16 matmul throughput
    report.py       markdown tables (`md_head`, `md_row`), JSON results (`write_json`), the machine
                    a CPU benchmark ran on (`machine_line`)
    postgres.py     a scratch PostgreSQL database for a run (`scratch_database`)
    reliability.py  the reliability benchmarks' table of checks (`Report`), a request sent byte for
                    byte (`send_raw`) and a process's resident memory (`rss_mb`)

report.py, postgres.py and reliability.py import only the standard library (postgres.py
SQLAlchemy when used): the audit and sidecar benchmarks run without torch. timing.py needs
torch, floors.py Triton too.
"""
