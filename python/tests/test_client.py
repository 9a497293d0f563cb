"""kvtier.Client against a real kvtierd: put/get/lookup/plan/stats, keys equal
to the CLI's, errors, hostile input, and a killed daemon."""
from __future__ import annotations

import os
import random
import re
import struct
import subprocess
import sys

import pytest

import kvtier
from kvtier import codec

FP = kvtier.ModelIdentity("test/model", codec="k16v16").fingerprint()


def bf16_bits(n: int, seed: int) -> bytes:
    """n bf16 values in [-2, 2) as raw bits (the top half of float32s)."""
    rnd = random.Random(seed)
    floats = struct.pack(f"<{n}f", *(rnd.uniform(-2, 2) for _ in range(n)))
    return b"".join(floats[i + 2:i + 4] for i in range(0, len(floats), 4))


def make_chunk(seed: int = 0, codec_name: str = "k16v16", tokens: int = 32, layers: int = 2):
    spec = codec.ChunkSpec(FP, num_layers=layers, num_kv_heads=2, head_dim=64,
                           num_tokens=tokens, block_size=16, codec=codec_name)
    k = bf16_bits(spec.elements, seed)
    v = bf16_bits(spec.elements, seed + 1000)
    return spec, k, v, bytes(codec.encode_chunk(spec, k, v))


def key_of(i: int) -> bytes:
    return kvtier.chunk_keys(FP, [i] * 16, chunk_tokens=16)[0]


def test_put_get_round_trip_zero_copy(daemon):
    spec, k, v, chunk = make_chunk()
    with kvtier.Client(socket=daemon.socket) as c:
        assert c.uses_shared_memory
        c.put(key_of(1), chunk)
        with c.get(key_of(1)) as got:
            assert got.tier == "dram"
            assert len(got) == len(chunk)
            assert got.data.readonly
            assert bytes(got.data) == chunk
            info, k2, v2 = codec.decode_chunk(got.data)
        assert (info.num_layers, info.num_tokens, info.codec) == (2, 32, "k16v16")
        assert bytes(k2) == k and bytes(v2) == v  # k16v16 is lossless
        # The same key given as hex.
        assert c.get_bytes(kvtier.key_hex(key_of(1))) == chunk


def test_get_miss_is_not_found(daemon):
    with kvtier.Client(socket=daemon.socket) as c:
        with pytest.raises(kvtier.NotFound) as e:
            c.get(key_of(99))
        assert e.value.code == 5
        assert isinstance(e.value, KeyError) and isinstance(e.value, kvtier.KvtierError)
        assert e.value.reason


def test_lookup_plan_delete_stats(daemon):
    keys = [key_of(i) for i in range(4)]
    with kvtier.Client(socket=daemon.socket) as c:
        for i in (0, 1, 3):  # a hole at 2: the cached prefix is 2 chunks
            c.put(keys[i], make_chunk(seed=i)[3])
        assert c.lookup(keys) == ["dram", "dram"]
        assert c.lookup([]) == []
        plan = c.plan_load(keys, prefill_tokens_per_s=1000.0, tokens_per_chunk=32)
        assert plan.hits == 2 and plan.tiers == ["dram", "dram"]
        assert plan.chunk_bytes == [len(make_chunk()[3])] * 2
        assert all(us > 0 for us in plan.load_us)
        # At 1000 tokens/s a 32-token chunk costs 32 ms to recompute: loading
        # a small chunk from DRAM pays.
        assert plan.load_chunks == 2 and plan.saved_us > plan.load_chunks_us
        stats = c.stats()
        dram = [t for t in stats["tiers"] if t["tier"] == "dram"][0]
        assert dram["chunks"] == 3 and dram["used_bytes"] > 0
        assert isinstance(stats["counters"], dict)
        c.delete(keys[1])
        assert c.lookup(keys) == ["dram"]
        with pytest.raises(kvtier.NotFound):
            c.delete(keys[1])


@pytest.mark.parametrize("data_plane", [0, 2])
def test_plan_prices_recompute_with_the_attention_term(daemon, data_plane):
    """attention_doubling_tokens reaches kvtierd's plan, over the data plane
    and over gRPC: at 2M tokens/s a 32-token chunk recomputes in 16 us, less
    than its DRAM load; with C2 = 32 tokens chunk i costs 16 * (1.5 + i) us
    (24, 40, 56, 72), more than its load. A C2 that is no length is
    InvalidArgument."""
    keys = [key_of(i) for i in range(10, 14)]
    with kvtier.Client(socket=daemon.socket, max_data_connections=data_plane) as c:
        for i, key in enumerate(keys):
            c.put(key, make_chunk(seed=i)[3])
        linear = c.plan_load(keys, prefill_tokens_per_s=2e6, tokens_per_chunk=32)
        assert linear.hits == 4 and linear.load_chunks == 0
        assert all(16 < us for us in linear.load_us)
        assert c.plan_load(keys, 2e6, 32, attention_doubling_tokens=0.0).load_chunks == 0
        plan = c.plan_load(keys, prefill_tokens_per_s=2e6, tokens_per_chunk=32,
                           attention_doubling_tokens=32.0)
        assert plan.hits == 4 and plan.load_chunks == 4
        assert plan.load_chunks_us == pytest.approx(sum(plan.load_us))
        assert plan.saved_us == pytest.approx(24 + 40 + 56 + 72 - plan.load_chunks_us)
        for bad in (-1.0, float("nan"), float("inf"), -float("inf")):
            for rate in (0.0, 2e6):
                with pytest.raises(kvtier.InvalidArgument) as e:
                    c.plan_load(keys, rate, 32, attention_doubling_tokens=bad)
                assert e.value.code == 3 and "attention_doubling_tokens" in e.value.reason
        assert c.lookup(keys) == ["dram"] * 4  # the connection still serves


def test_prefetch_from_nvme(daemon):
    with kvtier.Client(socket=daemon.socket) as c:
        c.put(key_of(7), make_chunk(seed=7)[3], durable=True)
        assert c.prefetch([key_of(7)], deadline_ms=5000)
        assert c.lookup([key_of(7)]) == ["dram"]


def test_prefix_keys_match_cli(kvtier_cli):
    tokens = list(range(1000, 1600))
    cases = [
        dict(),
        dict(codec="k16v16", kv_layout="hnd", dtype="fp16", revision="abc", tp_world_size=2,
             tp_rank=1),
    ]
    for kw in cases:
        for chunk_tokens, partial in ((256, False), (128, True)):
            ours = kvtier.prefix_keys("meta-llama/Llama-3.1-8B", tokens, chunk_tokens,
                                      partial=partial, **kw)
            args = [kvtier_cli, "keys", "--model-id", "meta-llama/Llama-3.1-8B", "--tokens",
                    ",".join(map(str, tokens)), "--chunk-tokens", str(chunk_tokens)]
            flags = {"codec": "--codec", "kv_layout": "--kv-layout", "dtype": "--dtype",
                     "revision": "--revision", "tp_world_size": "--tp-size",
                     "tp_rank": "--tp-rank"}
            for name, value in kw.items():
                args += [flags[name], str(value)]
            if partial:
                args.append("--partial")
            out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
            cli = re.findall(r"^chunk \d+ ([0-9a-f]{32})$", out, re.M)
            assert [kvtier.key_hex(k) for k in ours] == cli
            assert len(cli) == len(tokens) // chunk_tokens + (1 if partial else 0)


def test_prefix_keys_chain():
    tokens = list(range(512))
    a = kvtier.prefix_keys("m", tokens)
    b = kvtier.prefix_keys("m", tokens[:256] + [7] * 256)
    assert a[0] == b[0] and a[1] != b[1]  # same first chunk, different second
    assert kvtier.prefix_keys("other", tokens)[0] != a[0]
    assert kvtier.prefix_keys("m", tokens[:255]) == []


def test_hostile_keys_and_arguments(daemon):
    with kvtier.Client(socket=daemon.socket) as c:
        for bad in (b"short", b"x" * 17, "zz" * 16, "abc", ""):
            with pytest.raises(kvtier.InvalidArgument):
                c.get(bad)
        with pytest.raises(TypeError):
            c.get(12345)
        with pytest.raises(TypeError):
            c.put(key_of(1), 12345)
        with pytest.raises(kvtier.InvalidArgument):
            kvtier.prefix_keys("m", [-1, 2, 3])
        with pytest.raises(kvtier.InvalidArgument):
            kvtier.prefix_keys("m", [2**32])
        with pytest.raises(kvtier.InvalidArgument):
            kvtier.prefix_keys("m", [1, 2], chunk_tokens=0)
        with pytest.raises(kvtier.InvalidArgument):
            kvtier.prefix_keys("", [1, 2])  # empty model id
        with pytest.raises(kvtier.InvalidArgument):
            kvtier.ModelIdentity("m", tp_world_size=1, tp_rank=1).fingerprint()
        # Integers outside their C type are refused, never wrapped (2**32 as
        # a uint32_t would be 0; 2**32 + 256 would be 256).
        with pytest.raises(kvtier.InvalidArgument):
            kvtier.ModelIdentity("m", tp_world_size=2**32 + 1, tp_rank=1).fingerprint()
        with pytest.raises(kvtier.InvalidArgument):
            c.plan_load([key_of(1)], 1000.0, tokens_per_chunk=2**32 + 256)
        with pytest.raises(kvtier.InvalidArgument):
            c.prefetch([key_of(1)], deadline_ms=2**32)
        with pytest.raises(kvtier.InvalidArgument):
            c.prefetch([key_of(1)], deadline_ms=-1)
        with pytest.raises(kvtier.InvalidArgument):
            kvtier.Client(socket=daemon.socket, timeout_ms=2**63)
        with pytest.raises(kvtier.InvalidArgument):
            kvtier.Client(socket=daemon.socket, max_data_connections=2**31)
        assert c.plan_load([key_of(1)], 1000.0, tokens_per_chunk=256).hits == 0


def test_put_rejects_bad_chunks_and_keeps_good_ones(daemon):
    spec, k, v, chunk = make_chunk()
    with kvtier.Client(socket=daemon.socket) as c:
        c.put(key_of(1), chunk)
        with pytest.raises(kvtier.InvalidArgument):
            c.put(key_of(2), b"not a chunk" * 20)
        with pytest.raises(kvtier.KvtierError):
            c.put(key_of(2), b"")
        with pytest.raises(kvtier.KvtierError):
            c.put(key_of(2), chunk[:-1])  # truncated
        flipped = bytearray(chunk)
        flipped[-10] ^= 0x40  # a payload bit: the V checksum no longer matches
        with pytest.raises(kvtier.DataLoss):
            c.put(key_of(2), flipped)
        oversized = chunk + b"\0" * 64
        with pytest.raises(kvtier.KvtierError):
            c.put(key_of(2), oversized)
        assert c.lookup([key_of(2)]) == []
        assert c.get_bytes(key_of(1)) == chunk  # nothing lost


def pinned(client, key) -> bool:
    """True while a hold pins the chunk: the daemon refuses to delete it."""
    try:
        client.delete(key)
    except kvtier.KvtierError as e:
        assert not isinstance(e, kvtier.NotFound)
        return True
    return False


def test_chunk_release_rules(daemon):
    chunk_bytes = make_chunk()[3]
    with kvtier.Client(socket=daemon.socket) as c:
        c.put(key_of(1), chunk_bytes)
        chunk = c.get(key_of(1))
        view = chunk.data[10:20]  # a slice keeps the bytes, and the hold, alive
        chunk.release()
        chunk.release()  # idempotent
        with pytest.raises(ValueError):
            chunk.data
        assert bytes(view) == chunk_bytes[10:20]
        assert pinned(c, key_of(1))
        del view
        assert not pinned(c, key_of(1))  # the last view gone: hold ended, chunk deleted
        # A chunk left to the garbage collector ends its hold too.
        c.put(key_of(1), chunk_bytes)
        c.get(key_of(1))
        assert not pinned(c, key_of(1))


CHUNK_OUTLIVES_CLIENT = r"""
import gc, sys
sys.path.insert(0, sys.argv[1])
import kvtier
sock, key, want = sys.argv[2], bytes.fromhex(sys.argv[3]), sys.argv[4]
# A chunk read through a client that is then closed, and one whose client was
# never kept (the one-liner): both stay readable, nothing is unmapped under them.
c = kvtier.Client(socket=sock)
chunk = c.get(key)
view = chunk.data[:64]
c.close()
gc.collect()
assert bytes(chunk.data).hex()[:len(want)] == want, "closed client"
assert bytes(view).hex() == want[:128]
chunk.release()
assert bytes(view).hex() == want[:128]
del view
one = kvtier.Client(socket=sock).get(key)
gc.collect()
assert bytes(one.data).hex()[:len(want)] == want, "collected client"
data = one.data
del one
gc.collect()
assert bytes(data[:64]).hex() == want[:128]
del data
gc.collect()
print("ok")
"""


def test_chunk_outlives_its_client(daemon):
    """A chunk (and any view of it) read through a client stays readable after
    that client is closed or collected; a crash shows as the child's signal."""
    chunk = make_chunk()[3]
    with kvtier.Client(socket=daemon.socket) as c:
        c.put(key_of(1), chunk)
    pkg = os.path.dirname(os.path.dirname(kvtier.__file__))
    r = subprocess.run([sys.executable, "-c", CHUNK_OUTLIVES_CLIENT, pkg, daemon.socket,
                        key_of(1).hex(), chunk[:256].hex()],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.strip() == "ok"
    with kvtier.Client(socket=daemon.socket) as c:
        assert not pinned(c, key_of(1))  # every hold ended with its last view


CORE_WITHOUT_TORCH = r"""
import sys
sys.path.insert(0, sys.argv[1])
import kvtier, kvtier.client, kvtier.codec, kvtier.errors, kvtier.keys, kvtier._native
import kvtier.integrations
kvtier.key_hex(kvtier.prefix_keys("m", range(256))[0])  # the library loaded and called
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


def test_core_imports_no_torch():
    """The core (client, keys, codec, errors, the library loader) imports no
    torch, in an interpreter that has it: kvtier.torch and the integrations do."""
    pkg = os.path.dirname(os.path.dirname(kvtier.__file__))
    r = subprocess.run([sys.executable, "-c", CORE_WITHOUT_TORCH, pkg],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]"


def test_codec_hostile_input():
    spec, k, v, chunk = make_chunk(codec_name="k16v8")
    info = codec.inspect_chunk(chunk)
    assert info.codec == "k16v8" and info.total_bytes == len(chunk)
    assert codec.chunk_bytes(spec) == len(chunk)
    for bad in (chunk[:-1], chunk[:100], b"", chunk + b"\0"):
        with pytest.raises(kvtier.KvtierError):
            codec.inspect_chunk(bad)
    corrupt = bytearray(chunk)
    corrupt[200] ^= 1
    with pytest.raises(kvtier.DataLoss):
        codec.decode_chunk(corrupt)
    header = bytearray(chunk)
    header[24] = 0xFF  # num_layers: the header checksum no longer matches
    with pytest.raises(kvtier.KvtierError):
        codec.decode_chunk(header)
    with pytest.raises(kvtier.InvalidArgument):
        codec.decode_chunk(chunk, layers=(1, 5))
    with pytest.raises(kvtier.InvalidArgument):
        codec.encode_chunk(spec, k[:-2], v)
    with pytest.raises(kvtier.InvalidArgument):
        codec.chunk_bytes(codec.ChunkSpec(FP, 2, 2, 64, 32, codec="k99v99"))
    with pytest.raises(kvtier.InvalidArgument):
        codec.chunk_bytes(codec.ChunkSpec(FP, 0, 2, 64, 32))


def test_codec_k16v8_close_and_layer_ranges():
    spec, k, v, chunk = make_chunk(codec_name="k16v8", layers=3)
    info, k2, v2 = codec.decode_chunk(chunk)
    assert bytes(k2) == k  # keys stay 16-bit
    def floats(bits):
        return [struct.unpack("<f", b"\0\0" + bits[i:i + 2])[0] for i in range(0, len(bits), 2)]
    a, b = floats(v), floats(bytes(v2))
    err = max(abs(x - y) for x, y in zip(a, b))
    assert 0 < err < 0.15  # FP8 e4m3 with per-(block, head) scales over [-2, 2)
    _, k_mid, v_mid = codec.decode_chunk(chunk, layers=(1, 2))
    per_layer = len(k2) // 3
    assert bytes(k_mid) == bytes(k2[per_layer:2 * per_layer])
    assert bytes(v_mid) == bytes(v2[per_layer:2 * per_layer])


def test_missing_daemon_and_killed_daemon(tmp_path, daemon):
    with pytest.raises(kvtier.Unavailable):
        kvtier.Client(socket=str(tmp_path / "nothing.sock"), timeout_ms=2000)
    c = kvtier.Client(socket=daemon.socket, timeout_ms=2000)
    c.put(key_of(1), make_chunk()[3])
    daemon.kill()
    with pytest.raises(kvtier.KvtierError) as e:
        c.lookup([key_of(1)])
    assert e.value.code in (14, 4)  # UNAVAILABLE, or the deadline of a dead peer
    assert e.value.reason
    with pytest.raises(kvtier.KvtierError):
        c.get(key_of(1))
    c.close()
    with pytest.raises(ValueError):
        c.lookup([key_of(1)])


def test_tcp_with_token_file(tmp_path):
    from conftest import Daemon
    token = tmp_path / "token"
    token.write_text("0123456789abcdef0123456789abcdef-test\n")
    os.chmod(token, 0o600)
    d = Daemon(tmp_path / "d", extra=("--listen-tcp", "127.0.0.1:0", "--token-file",
                                      str(token))).start()
    try:
        port = re.search(r"tcp port (\d+)", open(d.ready).read()).group(1)
        chunk = make_chunk()[3]
        with kvtier.Client(addr=f"127.0.0.1:{port}", token_file=str(token)) as c:
            assert not c.uses_shared_memory
            c.put(key_of(3), chunk)
            with c.get(key_of(3)) as got:
                assert bytes(got.data) == chunk and got.tier == "dram"
            # Host pages without shared memory: encoded into a buffer and put,
            # got into a copy (checked as it is copied) and decoded from it.
            spec, k, v, _ = make_chunk(seed=6)
            row = spec.num_kv_heads * spec.head_dim
            rows = [token_major(x, spec.num_layers, spec.num_tokens, row) for x in (k, v)]
            assert c.put_pages(spec, [key_of(4)], [page_of(*rows, spec.num_layers, row)],
                               threads=2).errors == [None]
            out = [bytearray(len(rows[0])) for _ in range(2)]
            got_pages = c.get_pages(spec, [key_of(4), key_of(5)],
                                    [page_of(*out, spec.num_layers, row)] * 2)
            assert got_pages.errors[0] is None and out == rows
            assert isinstance(got_pages.errors[1], kvtier.NotFound)
        with pytest.raises(kvtier.Unauthenticated):
            kvtier.Client(addr=f"127.0.0.1:{port}", token="wrong", timeout_ms=5000)
        empty = tmp_path / "empty"
        empty.write_text("  \n")
        with pytest.raises(kvtier.InvalidArgument):
            kvtier.Client(addr=f"127.0.0.1:{port}", token_file=str(empty))
        with pytest.raises(kvtier.NotFound):
            kvtier.Client(addr=f"127.0.0.1:{port}", token_file=str(tmp_path / "absent"))
        with pytest.raises(kvtier.InvalidArgument):
            kvtier.Client(addr=f"127.0.0.1:{port}", token="a", token_file=str(token))
    finally:
        d.kill()


def make_certs(d) -> dict:
    """A CA, a daemon certificate for 127.0.0.1 and a client certificate,
    made with the openssl CLI; returns their paths."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run = lambda *a: subprocess.run(["openssl", *a], check=True, capture_output=True)
    run("req", "-x509", *ec, "-keyout", f"{d}/ca.key", "-out", f"{d}/ca.pem", "-subj", "/CN=ca",
        "-days", "30")
    for name, san in (("server", "IP:127.0.0.1"), ("client", "DNS:py.clients")):
        (d / f"{name}.ext").write_text(f"subjectAltName={san}\n")
        run("req", *ec, "-keyout", f"{d}/{name}.key", "-out", f"{d}/{name}.csr", "-subj", f"/CN={name}")
        run("x509", "-req", "-in", f"{d}/{name}.csr", "-CA", f"{d}/ca.pem", "-CAkey", f"{d}/ca.key",
            "-CAcreateserial", "-out", f"{d}/{name}.pem", "-days", "30", "-extfile", f"{d}/{name}.ext")
        os.chmod(d / f"{name}.key", 0o600)
    return {n: str(d / n) for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


def test_tcp_with_mutual_tls(tmp_path):
    from conftest import Daemon
    certs = make_certs(tmp_path)
    token = tmp_path / "token"
    token.write_text("0123456789abcdef0123456789abcdef-test\n")
    os.chmod(token, 0o600)
    d = Daemon(tmp_path / "d", extra=("--listen-tcp", "127.0.0.1:0", "--token-file", str(token),
                                      "--tls-cert", certs["server.pem"], "--tls-key", certs["server.key"],
                                      "--tls-client-ca", certs["ca.pem"])).start()
    try:
        ready = open(d.ready).read()
        assert "mutual TLS" in ready
        addr = "127.0.0.1:" + re.search(r"tcp port (\d+)", ready).group(1)
        chunk = make_chunk()[3]
        with kvtier.Client(addr=addr, token_file=str(token), tls_ca=certs["ca.pem"],
                           tls_cert=certs["client.pem"], tls_key=certs["client.key"]) as c:
            c.put(key_of(4), chunk)
            assert c.get_bytes(key_of(4)) == chunk
        # No client certificate, or plaintext: the handshake fails.
        with pytest.raises(kvtier.Unavailable):
            kvtier.Client(addr=addr, token_file=str(token), tls_ca=certs["ca.pem"], timeout_ms=3000)
        with pytest.raises(kvtier.Unavailable):
            kvtier.Client(addr=addr, token_file=str(token), timeout_ms=3000)
        with pytest.raises(kvtier.InvalidArgument):
            kvtier.Client(addr=addr, token_file=str(token), tls_cert=certs["client.pem"])
    finally:
        d.kill()


def token_major(flat: bytes, layers: int, tokens: int, row: int, pad: int = 0) -> bytearray:
    """[layers][tokens][row] 16-bit elements rearranged token-major (SGLang's
    page_first host pool): row (l, t) at element t * (layers * row + pad) + l * row."""
    stride = layers * row + pad
    out = bytearray(b"\xaa" * (2 * stride * tokens))
    for layer in range(layers):
        for t in range(tokens):
            src = 2 * (layer * tokens + t) * row
            dst = 2 * (t * stride + layer * row)
            out[dst:dst + 2 * row] = flat[src:src + 2 * row]
    return out


def page_of(k: bytearray, v: bytearray, layers: int, row: int, pad: int = 0) -> kvtier.HostPage:
    ka, _, _ = _native_address(k)
    va, _, _ = _native_address(v)
    return kvtier.HostPage(ka, va, row, layers * row + pad)


def _native_address(buf):
    from kvtier import _native
    return _native.buffer_address(buf, writable=True)


@pytest.mark.parametrize("codec_name", ["k16v16", "k16v8"])
def test_host_pages_round_trip_in_place(daemon, codec_name):
    spec, k, v, chunk = make_chunk(seed=3, codec_name=codec_name)
    row = spec.num_kv_heads * spec.head_dim
    rows = [token_major(x, spec.num_layers, spec.num_tokens, row, pad=5) for x in (k, v)]
    pages = [page_of(*rows, spec.num_layers, row, pad=5)]
    with kvtier.Client(socket=daemon.socket) as c:
        put = c.put_pages(spec, [key_of(300)], pages)
        assert put.errors == [None] and put.bytes == len(chunk)
        # Encoded in the pool in place, sealed by the daemon: the same bytes as
        # the codec's own chunk of the contiguous K and V.
        assert c.get_bytes(key_of(300)) == chunk
        out = [bytearray(b"\xaa" * len(rows[0])) for _ in range(2)]
        got = c.get_pages(spec, [key_of(300)], [page_of(*out, spec.num_layers, row, pad=5)],
                          threads=2)
        assert got.errors == [None] and got.bytes == len(chunk)
        _, dk, dv = codec.decode_chunk(chunk)
        assert out[0] == token_major(bytes(dk), spec.num_layers, spec.num_tokens, row, pad=5)
        assert out[1] == token_major(bytes(dv), spec.num_layers, spec.num_tokens, row, pad=5)


def test_host_pages_misses_foreign_corrupt_and_hostile_pages(daemon):
    from conftest import corrupt_in_pool
    spec, k, v, chunk = make_chunk(seed=4)
    row = spec.num_kv_heads * spec.head_dim
    src = [bytearray(x) for x in (k, v)]  # layer-major: the chunk's own order

    def contiguous(pair):
        ka, _, _ = _native_address(pair[0])
        va, _, _ = _native_address(pair[1])
        return kvtier.HostPage(ka, va, spec.num_tokens * row, row)

    with kvtier.Client(socket=daemon.socket) as c:
        keys = [key_of(310 + i) for i in range(3)]
        assert c.put_pages(spec, keys[:2], [contiguous(src)] * 2, threads=4).errors == [None] * 2
        corrupt_in_pool(c, keys[1])
        foreign = kvtier.ModelIdentity("other/model", codec="k16v16").fingerprint()
        c.put(key_of(313), codec.encode_chunk(
            codec.ChunkSpec(foreign, spec.num_layers, spec.num_kv_heads, spec.head_dim,
                            spec.num_tokens, codec="k16v16"), k, v))
        outs = [[bytearray(len(k)), bytearray(len(v))] for _ in range(4)]
        got = c.get_pages(spec, keys + [key_of(313)], [contiguous(o) for o in outs])
        assert got.errors[0] is None and bytes(outs[0][0]) == k and bytes(outs[0][1]) == v
        assert isinstance(got.errors[1], kvtier.DataLoss)
        assert isinstance(got.errors[2], kvtier.NotFound)
        assert isinstance(got.errors[3], kvtier.InvalidArgument)
        assert str(got.errors[1]).startswith("DATA_LOSS: page 1: ")  # the first failure's
        assert "not the page's" not in str(got.errors[3])  # only the first keeps its message
        assert bytes(outs[3][0]) == bytes(len(k))  # a foreign chunk writes nothing
        with pytest.raises(kvtier.NotFound):  # the daemon dropped the corrupt chunk
            c.get(keys[1])
        # A header byte gone bad in the pool (the version field): corruption of
        # a chunk the daemon verified at put, so DataLoss and dropped, not an
        # argument error that would leave it there.
        assert c.put_pages(spec, [key_of(315)], [contiguous(src)]).errors == [None]
        corrupt_in_pool(c, key_of(315), offset=4)
        out = [bytearray(len(k)), bytearray(len(v))]
        bad_header = c.get_pages(spec, [key_of(315)], [contiguous(out)]).errors[0]
        assert isinstance(bad_header, kvtier.DataLoss) and "version" in str(bad_header)
        assert bytes(out[0]) == bytes(len(k))
        with pytest.raises(kvtier.NotFound):
            c.get(key_of(315))
        # Rows that overlap, and keys that do not match the pages: refused
        # before any slot or hold is taken.
        bad = kvtier.HostPage(contiguous(src).k, contiguous(src).v, row, row)
        r = c.put_pages(spec, [key_of(320)], [bad])
        assert isinstance(r.errors[0], kvtier.InvalidArgument) and "overlap" in str(r.errors[0])
        with pytest.raises(kvtier.NotFound):
            c.get(key_of(320))
        with pytest.raises(kvtier.InvalidArgument):
            c.get_pages(spec, keys, [contiguous(src)])
        assert c.get_pages(spec, [], []).errors == []
        stats = c.stats()["counters"]
        assert stats["slots_expired"] == 0


def test_host_pages_from_nvme(tmp_path):
    """Pages evicted to NVMe come back (the daemon reads each into a scratch
    slot and checks it as it reads); a repeated key and a miss in a batch."""
    from conftest import Daemon
    d = Daemon(tmp_path / "d", dram_gib="0.03125", nvme_gib="0.25").start()
    try:
        spec = codec.ChunkSpec(FP, num_layers=8, num_kv_heads=8, head_dim=128, num_tokens=64,
                               block_size=64, codec="k16v16")  # 1 MiB a page
        n = 48
        src = [bytearray(bf16_bits(spec.elements // 64, s) * 64) for s in range(2 * n)]
        row = spec.num_kv_heads * spec.head_dim

        def page(k, v):
            ka, _, _ = _native_address(k)
            va, _, _ = _native_address(v)
            return kvtier.HostPage(ka, va, spec.num_tokens * row, row)

        keys = [key_of(400 + i) for i in range(n)]
        with kvtier.Client(socket=d.socket) as c:
            put = c.put_pages(spec, keys, [page(src[2 * i], src[2 * i + 1]) for i in range(n)],
                              threads=4)
            assert put.errors == [None] * n
            assert "nvme" in c.lookup(keys)  # the DRAM tier holds about half
            outs = [(bytearray(len(src[0])), bytearray(len(src[0]))) for _ in keys]
            got = c.get_pages(spec, keys, [page(*o) for o in outs], threads=4)
            assert got.errors == [None] * n
            for i, (k, v) in enumerate(outs):
                assert k == src[2 * i] and v == src[2 * i + 1], i
            # A repeated key and a miss.
            again = [(bytearray(len(src[0])), bytearray(len(src[0]))) for _ in range(3)]
            got = c.get_pages(spec, [keys[5], keys[5], key_of(499)], [page(*o) for o in again])
            assert got.errors[:2] == [None, None] and isinstance(got.errors[2], kvtier.NotFound)
            assert again[0] == again[1] == (src[10], src[11])
            assert c.stats()["counters"]["hits_nvme"] > 0
    finally:
        d.kill()
