"""The SGLang half of test_cross_engine.py, run by the SGLang venv's Python
(vLLM and SGLang live in separate venvs): builds SGLang's host pool and
KvtierHiCacheStorage through SGLang's factory, asks it which of the given keys
kvtierd holds, loads those pages with batch_get_v1, and writes what it found
and the pages' K and V to a torch file.

    python sglang_fetch.py SOCKET MODEL_ID PAGE LAYERS HEADS DIM OUT KEY_HEX...
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # kvtier
from test_sglang_backend import backend, host_pool, indices, page_kv  # noqa: E402


class _Daemon:
    def __init__(self, socket: str):
        self.socket = socket


def main(argv) -> None:
    socket, model_id, page, layers, heads, dim, out, *keys = argv
    page, layers, heads, dim = int(page), int(layers), int(heads), int(dim)
    pool = host_pool("page_first", 0, page, layers, heads, dim)
    b = backend(_Daemon(socket), pool, model_name=model_id)
    hits = b.batch_exists(keys)
    ok = b.batch_get_v1(keys[:hits], indices(range(hits), page))
    k = [page_kv(pool, i * page)[0] for i in range(hits)]
    v = [page_kv(pool, i * page)[1] for i in range(hits)]
    torch.save({"hits": hits, "ok": ok, "keys": [b.kvtier_key(x).hex() for x in keys],
                "k": k, "v": v}, out)
    b.close()


if __name__ == "__main__":
    main(sys.argv[1:])
