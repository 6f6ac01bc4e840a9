"""Interpret-mode parity of the Pallas paged-attention kernels with their pure-jnp references.

Every kernel runs under JAX's GPU interpreter on the CPU (shared memory, barriers, TMA copies
simulated), on ragged batches whose sequences cover the edge lengths 1, page_size-1, page_size,
page_size+1 and a long one spanning several KV tiles (so the two-stage copy ring and the online
softmax across tiles run), over shuffled pages in a pool whose every unowned slot holds large
garbage: reading a wrong slot unmasked shows up as a large error. The default run covers head dims,
page sizes, GQA ratios, sliding window, soft-cap and both dtypes with a covering set of cases (each
dimension's values all appear); `pytest -m slow` runs the full product, which a plain `pytest`
deselects (pyproject's addopts).

Tolerances (max |out - ref| over real rows, outputs are O(1)): float32 1e-5 (observed ~1e-6);
bfloat16 4e-2 with relative Frobenius error 1e-2 (the kernel rounds P to bf16 for the tensor-core PV
product and rounds its output to bf16; observed ~1.6e-2 max, i.e. two bf16 ulps at magnitude 2).

Where JAX's default backend is a GPU, the parity cases run the kernels compiled for it instead of
interpreted (bfloat16 only: float32 pages are an interpret-mode feature and skip there); the race
checks stay in interpret mode, where the race detector lives.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import common as pk_common
from jaxserve.ops.attention import ragged_paged_attention as xla_ragged_paged_attention
from pallas_kernels.interpret import races_found
from paged_helpers import SeqChunk, assign_pages, make_batch

ON_GPU = jax.default_backend() == "gpu"
NUM_KV_HEADS = 2
NUM_LAYERS = 2
LAYER = 1
TOL = {"float32": dict(atol=1e-5, rel=1e-5), "bfloat16": dict(atol=4e-2, rel=1e-2)}
max_errors: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def _report_errors():
    yield
    print("\nmax |kernel - reference| per dtype:", {k: f"{v:.1e}" for k, v in sorted(max_errors.items())})


@pytest.fixture(autouse=True)
def _full_precision_float32_dots():
    """On a GPU, XLA's default float32 dot runs on TF32 tensor cores (about 1e-3 off): the references
    and the interpreted float32 kernels are compared at full float32 precision."""
    with jax.default_matmul_precision("highest"):
        yield


def ragged_lengths(page_size: int) -> list[tuple[int, int]]:
    """(q_len, num_cached) per sequence: decode rows and prefill chunks at the page-edge lengths."""
    return [
        (1, 0),  # kv_len 1
        (1, page_size - 2),  # decode, kv_len page_size-1
        (page_size, 0),  # prefill of exactly one page
        (page_size + 1, 0),
        (page_size - 1, 3),  # a chunk after a cached prefix, not page aligned
        (3, 150),  # a long sequence: > 1 KV tile of 128, and past the sliding window
        (64, 600),  # a chunk after a long prefix: more KV tiles than ring stages, consumers' ranges differ
    ]


def decode_lengths(page_size: int) -> list[tuple[int, int]]:
    return [(1, 0), (1, page_size - 2), (1, page_size - 1), (1, page_size), (0, 0), (1, 200)]


def build_case(lengths, *, page_size, head_dim, group, dtype, seed, num_tokens=None, extra_seqs=1):
    """Random q/k/v, shuffled pages, and the batch's metadata (padded rows and sequences included)."""
    rng = np.random.default_rng(seed)
    kv_lens = [q + c for q, c in lengths]
    num_pages = sum(-(-n // page_size) for n in kv_lens) + 4
    tables = assign_pages([max(n, 1) for n in kv_lens], page_size, num_pages, seed=seed)
    chunks = [SeqChunk([0] * q, c, t) for (q, c), t in zip(lengths, tables)]
    real_tokens = sum(q for q, _ in lengths)
    num_tokens = num_tokens or real_tokens + 3
    pages_per_seq = max(len(t) for t in tables) + 1
    batch = make_batch(chunks, page_size=page_size, pages_per_seq=pages_per_seq, num_tokens=num_tokens,
                       num_seqs=len(chunks) + extra_seqs)
    shape = (NUM_LAYERS, num_pages, page_size, NUM_KV_HEADS, head_dim)
    owned = np.zeros(shape[1:3], bool)  # [num_pages, page_size]: slots some sequence may attend to
    for n, table in zip(kv_lens, tables):
        for pos in range(n):
            owned[table[pos // page_size], pos % page_size] = True
    garbage = np.where(owned[None, :, :, None, None], 1.0, 100.0)  # unowned slots: large, finite
    k = rng.standard_normal(shape) * garbage
    v = rng.standard_normal(shape) * garbage
    q = rng.standard_normal((num_tokens, group * NUM_KV_HEADS, head_dim))
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), batch.md, real_tokens


def check(out, ref, real_tokens, dtype, what):
    out = np.asarray(out.astype(jnp.float32))
    ref = np.asarray(ref.astype(jnp.float32))
    err = float(np.abs(out[:real_tokens] - ref[:real_tokens]).max())
    rel = float(np.linalg.norm(out[:real_tokens] - ref[:real_tokens]) / np.linalg.norm(ref[:real_tokens]))
    max_errors[dtype] = max(max_errors.get(dtype, 0.0), err)
    tol = TOL[dtype]
    assert err <= tol["atol"] and rel <= tol["rel"], f"{what}: max |Δ| {err:.2e}, relative {rel:.2e} ({tol})"
    assert not np.any(out[real_tokens:]), f"{what}: padding rows must be zeros"


def use_interpreter(dtype, detect_races):
    """Interpreted on a CPU and for race checks; compiled for the GPU where one is the default backend."""
    if detect_races or not ON_GPU:
        return True
    if dtype == "float32":
        pytest.skip("float32 KV pages run only in interpret mode")
    return False


def run_ragged(head_dim, page_size, group, window, soft_cap, dtype, seed=0, detect_races=False, lengths=None):
    interpret = use_interpreter(dtype, detect_races)
    q, k, v, md, real_tokens = build_case(lengths or ragged_lengths(page_size), page_size=page_size,
                                          head_dim=head_dim, group=group, dtype=dtype, seed=seed)
    args = (q, k, v, LAYER, md.cu_q_lens, md.kv_lens, md.block_tables)
    kw = dict(scale=head_dim**-0.5, soft_cap=soft_cap)
    kernel = jax.jit(functools.partial(pk.ragged_paged_attention, interpret=interpret, detect_races=detect_races, **kw))
    out = kernel(*args, sliding_window=window)
    ref = pk.ragged_paged_attention_reference(*args, sliding_window=window, **kw)
    check(out, ref, real_tokens, dtype, f"ragged D={head_dim} page={page_size} G={group} w={window} cap={soft_cap}")


def run_decode(head_dim, page_size, group, window, soft_cap, dtype, num_splits, seed=0, detect_races=False):
    interpret = use_interpreter(dtype, detect_races)
    lengths = decode_lengths(page_size)
    q, k, v, md, _ = build_case(lengths, page_size=page_size, head_dim=head_dim, group=group, dtype=dtype,
                                seed=seed, num_tokens=len(lengths) + 1)
    args = (q, k, v, LAYER, md.cu_q_lens, md.kv_lens, md.block_tables)
    kw = dict(scale=head_dim**-0.5, soft_cap=soft_cap)
    kernel = jax.jit(functools.partial(pk.decode_attention, interpret=interpret, detect_races=detect_races,
                                       num_splits=num_splits, **kw))
    out = kernel(*args, sliding_window=window)
    ref = pk.decode_attention_reference(*args, sliding_window=window, **kw)
    real_rows = int(md.cu_q_lens[-1])
    check(out, ref, real_rows, dtype, f"decode D={head_dim} page={page_size} G={group} w={window} "
                                      f"cap={soft_cap} splits={num_splits}")


# (head_dim, page_size, group, sliding_window, soft_cap, dtype): every value of every axis appears.
RAGGED_CASES = [
    (64, 16, 1, 0, 0.0, "float32"),
    (128, 32, 3, 21, 30.0, "bfloat16"),
    (256, 16, 4, 19, 0.0, "float32"),
    (64, 32, 8, 0, 30.0, "bfloat16"),
]
DECODE_CASES = [  # ... plus num_splits
    (64, 32, 3, 0, 30.0, "float32", 1),
    (128, 16, 8, 0, 0.0, "bfloat16", 3),
    (256, 32, 1, 17, 0.0, "bfloat16", 2),
    (64, 16, 4, 21, 50.0, "float32", 2),
]
HEAD_DIMS, PAGE_SIZES, GROUPS, DTYPES = (64, 128, 256), (16, 32), (1, 3, 4, 8), ("float32", "bfloat16")
FEATURES = [(0, 0.0), (19, 0.0), (0, 30.0), (19, 30.0)]  # (sliding_window, soft_cap)


@pytest.mark.parametrize("head_dim,page_size,group,window,soft_cap,dtype", RAGGED_CASES)
def test_ragged_kernel_matches_reference(head_dim, page_size, group, window, soft_cap, dtype):
    """Mixed decode rows and prefill chunks at the page-edge lengths, over shuffled garbage-filled pages:
    guards the tiling into (token, head) rows, the causal/window masks, soft-cap, the page walk and the
    cross-tile online softmax."""
    run_ragged(head_dim, page_size, group, window, soft_cap, dtype)


@pytest.mark.parametrize("head_dim,page_size,window", [(256, 128, 0), (64, 256, 40)])
def test_ragged_kernel_with_kv_tiles_inside_a_page(head_dim, page_size, window):
    """Pages larger than the ragged kernel's KV tile (head_dim 256 with 128-token pages: 64-key tiles;
    256-token pages: 128-key tiles): each TMA copy takes a slice of one page at an offset. Lengths put
    keys in both halves of pages, a chunk across a page boundary and a prefix over several pages."""
    lengths = [(1, 0), (1, page_size - 2), (40, page_size - 20), (20, 2 * page_size + 30)]
    run_ragged(head_dim, page_size, 8, window, 0.0, "bfloat16", lengths=lengths)


@pytest.mark.parametrize("head_dim,page_size,group,window,soft_cap,dtype,num_splits", DECODE_CASES)
def test_decode_kernel_matches_reference(head_dim, page_size, group, window, soft_cap, dtype, num_splits):
    """Decode rows at the page-edge lengths plus an empty sequence, keys split across programs: guards
    the split ranges, the partial-softmax merge (empty splits included) and padded sequences."""
    run_decode(head_dim, page_size, group, window, soft_cap, dtype, num_splits)


@pytest.mark.slow
@pytest.mark.parametrize("head_dim,page_size,group,dtype,features",
                         itertools.product(HEAD_DIMS, PAGE_SIZES, GROUPS, DTYPES, FEATURES))
def test_ragged_kernel_full_grid(head_dim, page_size, group, dtype, features):
    """The full product of the ragged kernel's grid (slow: ~5 s per case)."""
    run_ragged(head_dim, page_size, group, *features, dtype, seed=head_dim + page_size + group)


@pytest.mark.slow
@pytest.mark.parametrize("head_dim,page_size,group,dtype,features,num_splits",
                         itertools.product(HEAD_DIMS, PAGE_SIZES, GROUPS, DTYPES, FEATURES, (1, 3)))
def test_decode_kernel_full_grid(head_dim, page_size, group, dtype, features, num_splits):
    """The full product of the decode kernel's grid (slow)."""
    run_decode(head_dim, page_size, group, *features, dtype, num_splits, seed=head_dim + page_size + group)


@pytest.mark.parametrize("kernel,window", [("ragged", 0), ("ragged", 19), ("decode", 0)])
def test_no_races_detected(kernel, window):
    """The interpreter's race detector (one vector clock per TMA copy in flight) finds no unsynchronized
    access between the TMA copies and the kernel's reads and writes of shared memory. The ragged kernel
    runs its producer and two consumer warpgroups as threads: without a window its ring wraps (the
    producer waits for released slots); with one, a consumer passes over tiles before its own range."""
    if kernel == "ragged":
        run_ragged(64, 16, 4, window, 0.0, "float32", detect_races=True)
    else:
        run_decode(64, 16, 4, window, 0.0, "float32", num_splits=2, detect_races=True)
    assert not races_found()


def _skip_waits(monkeypatch, module, function, barrier_index):
    """Replaces module.function by one whose barrier_wait calls on its argument number `barrier_index`
    (a barrier ref) do nothing; returns the list of skipped waits."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    real, skipped = getattr(module, function), []

    def mutated(*args, **kw):
        barrier = args[barrier_index]

        def barrier_wait(b):
            if getattr(b, "ref", b) is barrier:
                skipped.append(b)
            else:
                plgpu.barrier_wait(b)

        monkeypatch.setattr(module, "plgpu", types.SimpleNamespace(**{**vars(plgpu), "barrier_wait": barrier_wait}))
        try:
            return real(*args, **kw)
        finally:
            monkeypatch.setattr(module, "plgpu", plgpu)

    monkeypatch.setattr(module, function, mutated)
    return skipped


# Without the wait the kernel reads a buffer before its copy lands: the interpreter multiplies what is there
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")
def test_race_detector_catches_a_missing_barrier_wait(monkeypatch):
    """The race checks above can fail: with the consumers' wait on each K slot's full barrier skipped, the
    interpreter reports the read of K racing with the TMA copy that fills it. The window keeps every
    program's KV tiles within one pass of the ring, so each slot fills once: a skipped wait on a slot that
    fills again would trip the interpreter's own phase check inside one simulated warpgroup and leave the
    others waiting on their barriers for ever."""
    ragged = importlib.import_module("pallas_kernels.ragged_paged_attention")
    skipped = _skip_waits(monkeypatch, ragged, "_consume", 4)  # (q, p, k, v, k_full, ...)
    try:
        run_ragged(64, 16, 4, 19, 0.0, "float32", detect_races=True)
    except AssertionError:
        pass  # the numbers may come out right or wrong; the race report is what is checked
    assert skipped, "the mutation did not apply"
    assert races_found()


@pytest.mark.skipif(ON_GPU, reason="checks the interpreter's runners; on a GPU the engine test counts compilations")
def test_an_interpreted_kernel_compiles_nothing_after_its_first_call():
    """Zero compilations after warm-up, at the kernel: a second call with new values of the same shapes
    compiles nothing, the interpreter's runner of each warpgroup included (JAX 0.10.2 on its own
    recompiles every warpgroup of every program on every call; pallas_kernels.interpret caches them),
    the interpreter's host callbacks included: XLA runs them on the calling thread or on one of its own,
    and under this module's matmul precision (a setting of this thread only) a later call that ran one on
    the other kind of thread compiled its jnp ops again (a flaky extra compilation)."""
    from jaxserve.runner import compilation

    q, k, v, md, _ = build_case(ragged_lengths(16), page_size=16, head_dim=64, group=4, dtype="float32", seed=0)
    kernel = jax.jit(functools.partial(pk.ragged_paged_attention, scale=0.125, interpret=True))
    args = (k, v, LAYER, md.cu_q_lens, md.kv_lens, md.block_tables)
    new_q = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), q.dtype)  # no op later: nothing to compile
    kernel(q, *args).block_until_ready()
    before = compilation.num_compilations()
    kernel(new_q, *args).block_until_ready()
    assert compilation.num_compilations() == before


def test_the_ragged_grid_reaches_every_path_of_the_ring():
    """The default parity cases exercise the warp-specialized kernel's synchronization, not just its math:
    some program has more KV tiles than ring stages (the producer waits for released slots), some consumer
    passes over tiles before and after its own range, and some consumer has no rows. Uses the kernel's own
    range functions on the cases' metadata."""
    ragged = importlib.import_module("pallas_kernels.ragged_paged_attention")
    reached = set()
    for head_dim, page_size, group, window, _, dtype in RAGGED_CASES:
        q, _, _, md, _ = build_case(ragged_lengths(page_size), page_size=page_size, head_dim=head_dim,
                                    group=group, dtype=dtype, seed=0)
        cfg = pk_common.choose_prefill_config(head_dim, page_size)
        wg_tokens = pk_common.ROWS // group
        (seq, first_pos, num_q), _ = ragged._tiles(md.cu_q_lens, md.kv_lens, q.shape[0],
                                                   pk_common.COMPUTE_WARPGROUPS * wg_tokens)
        kv_tiles = functools.partial(ragged.kv_tile_range, kv_len=md.kv_lens[seq], window=window,
                                     kv_tile=cfg.kv_tile)
        program = kv_tiles(first_pos, num_q)
        live = np.asarray(num_q > 0)
        if np.any(live & np.asarray(program[1] > cfg.num_stages)):
            reached.add("ring wraps")
        for wg in range(pk_common.COMPUTE_WARPGROUPS):
            wg_num_q = jnp.clip(num_q - wg * wg_tokens, 0, wg_tokens)
            lo, hi = ragged.consumer_steps(program, kv_tiles(first_pos + wg * wg_tokens, wg_num_q))
            has_rows = live & np.asarray(wg_num_q > 0)
            reached |= {name for name, hit in [("passes before", has_rows & np.asarray(lo > 0)),
                                               ("passes after", has_rows & np.asarray(hi < program[1])),
                                               ("no rows", live & ~has_rows)] if np.any(hit)}
    assert reached == {"ring wraps", "passes before", "passes after", "no rows"}


def test_reference_matches_the_xla_foundation_path():
    """The dense reference and the engine's XLA paged attention (flash-style, tiled) agree: the Pallas
    kernels are checked against the same function the engine runs on CPU."""
    for page_size, group, window, soft_cap in [(16, 3, 0, 0.0), (32, 4, 19, 30.0)]:
        q, k, v, md, real_tokens = build_case(ragged_lengths(page_size), page_size=page_size, head_dim=64,
                                              group=group, dtype="float32", seed=7)
        kw = dict(scale=0.125, sliding_window=window, soft_cap=soft_cap)
        ref = pk.ragged_paged_attention_reference(q, k, v, LAYER, md.cu_q_lens, md.kv_lens, md.block_tables, **kw)
        xla = xla_ragged_paged_attention(q, k, v, LAYER, md, q_tile=8, kv_tile=32, **kw)
        np.testing.assert_allclose(np.asarray(xla), np.asarray(ref), atol=1e-5)


def test_unsupported_shapes_are_refused_with_the_reason():
    """Shapes the kernels cannot take raise UnsupportedShapeError naming the value, at trace time."""
    ok = dict(num_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.bfloat16, interpret=False)
    pk.check_supported(**ok)
    for change, match in [(dict(head_dim=96), "head_dim=96"), (dict(page_size=4), "page_size=4"),
                          (dict(dtype=jnp.float32), "float32"), (dict(num_heads=7), "num_heads=7"),
                          (dict(head_dim=256, page_size=256), "shared memory")]:
        with pytest.raises(pk.UnsupportedShapeError, match=match):
            pk.check_supported(**{**ok, **change})
    pk.check_supported(**{**ok, "dtype": jnp.float32, "interpret": True})  # float32: interpret mode only
    q = jnp.zeros((4, 2, 96), jnp.bfloat16)
    pages = jnp.zeros((1, 4, 16, 1, 96), jnp.bfloat16)
    md = (jnp.array([0, 4]), jnp.array([4]), jnp.array([[1]]))
    with pytest.raises(pk.UnsupportedShapeError, match="head_dim=96"):
        pk.ragged_paged_attention(q, pages, pages, 0, *md, scale=1.0, interpret=True)
