"""llama.cpp's pp/tg on the same GGUF file, through the llama-cpp-python package from PyPI.

Settings match the reference of the goldens in tests/data/golden: flash attention on, the given thread count,
and no extra buffer types (AMX / repacked weights, which crash on some of these machines).
"""
import os
import sys
import time

import llama_cpp
from llama_cpp import Llama

_default_params = llama_cpp.llama_model_default_params


def _params():
    p = _default_params()
    p.use_extra_bufts = False
    return p


llama_cpp.llama.llama_cpp.llama_model_default_params = _params

model, threads = sys.argv[1], int(sys.argv[2])
np_, ng = int(os.environ.get("BENCH_PP", 512)), int(os.environ.get("BENCH_TG", 128))
m = Llama(model_path=model, n_ctx=np_ + ng + 16, n_batch=512, n_threads=threads, n_threads_batch=threads, flash_attn=True, verbose=False)
best_pp = best_tg = 0.0
for _ in range(3):
    m.reset()
    prompt = [100 + (i * 37) % 5000 for i in range(np_)]
    t0 = time.perf_counter()
    m.eval(prompt)
    best_pp = max(best_pp, np_ / (time.perf_counter() - t0))
    tok = 100
    t1 = time.perf_counter()
    for _ in range(ng):
        m.eval([tok])
    best_tg = max(best_tg, ng / (time.perf_counter() - t1))
print(f"llama.cpp pp{np_}={best_pp:.1f} tg{ng}={best_tg:.1f}")
