"""Pipeline schedules and the bubble: the simulator against the closed forms the playbook and the papers give."""

import itertools

import pytest

from lab.calc.bubble import bubble_ratio, dualpipe_bubble, explore, simulate, zb_h1_bubble
from lab.calc.schedules import B, F, Op, W, afab, interleaved, make_schedule, one_f_one_b, zb_h1


def test_one_f_one_b_order_reads_like_the_diagram():
    """Rank r: p - r - 1 warm-up forwards, then F/B in turn, then the cool-down backwards."""
    table = one_f_one_b(4, 6).table().splitlines()
    assert table[0] == "rank 0: F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5"
    assert table[3] == "rank 3: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"
    assert afab(2, 3).table().splitlines()[1] == "rank 1: F0 F1 F2 B0 B1 B2"


@pytest.mark.parametrize("p, m, v", [(p, m, v) for p, m, v in itertools.product((2, 4, 8), (1, 3, 8, 32), (1, 2, 4))
                                     if v == 1 or m % p == 0])
def test_every_op_once_and_the_simulator_never_deadlocks(p, m, v):
    for name in ("afab", "1f1b", "zb-h1", "zb-h2") if v == 1 else ("interleaved",):
        schedule = make_schedule(name, p, m, v)
        kinds = (F, B, W) if name.startswith("zb") else (F, B)
        for ops in schedule.ops:
            assert sorted(ops) == sorted(Op(k, i, c) for k in kinds for i in range(m) for c in range(v))
        simulate(schedule)


@pytest.mark.parametrize("p, m, v", [(4, 8, 1), (8, 8, 1), (8, 32, 1), (8, 32, 4), (8, 16, 8), (4, 4, 2), (2, 6, 3),
                                     (4, 12, 2)])
def test_bubble_ratio_equals_the_closed_form(p, m, v):
    """Playbook, "Pipeline Parallelism": r_bubble = (p-1)/(v·m) with t_b = 2·t_f — its 'Bubble size for PP=8'
    figure (0.875 at m=8, 0.21875 at m=32, 0.0547 at m=32 v=4) — and idle/total = (p-1)/(m+p-1) without interleaving."""
    names = ("afab", "1f1b") if v == 1 else ("interleaved",)
    for name in names:
        sim = explore(name, p, m, v, tf=1, tb=2)
        assert sim.bubble_ratio == pytest.approx(bubble_ratio(p, m, v))
        if v == 1:
            assert sim.idle_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert bubble_ratio(8, 32, 4) == pytest.approx(0.0547, abs=1e-4)


def test_afab_step_time_exercise():
    """Playbook exercise: t_f = 1, t_b = 2, p = 4, m = 8 gives (m + p - 1)(t_f + t_b) = 33."""
    assert explore("afab", 4, 8, tf=1, tb=2).makespan == 33
    assert explore("1f1b", 4, 8, tf=1, tb=2).makespan == 33


def test_in_flight_activations_afab_m_and_one_f_one_b_p_minus_r():
    assert explore("afab", 4, 8).peak_activations == [8, 8, 8, 8]
    assert explore("1f1b", 4, 8).peak_activations == [4, 3, 2, 1]
    assert explore("1f1b", 4, 2).peak_activations == [2, 2, 2, 1]
    # ZB-H1 holds a micro-batch until its W (the weight gradients need the layers' inputs): p on every rank
    assert explore("zb-h1", 4, 8).peak_activations == [4, 4, 4, 4]
    # Megatron's interleaved warm-up: (p - r - 1)·2 + (v - 1)·p + 1 chunks of 1/v stage each
    assert explore("interleaved", 4, 8, 2).peak_activations == [5.5, 4.5, 3.5, 2.5]


@pytest.mark.parametrize("p, m", [(2, 4), (4, 4), (4, 8), (8, 16), (3, 7)])
@pytest.mark.parametrize("tf, tb, tw", [(1, 2, 1), (1, 2, 0.5), (2, 3, 1), (1.5, 3, 1.5)])
def test_zb_h1_bubble_is_the_papers(p, m, tf, tb, tw):
    """Qi et al. 2023: ZB-H1 idles (p-1)(t_f + t_b - 2·t_w) — a third of 1F1B's (p-1)(t_f + t_b) when
    t_f = t_b - t_w = t_w — in their regime m >= p, t_w <= t_f."""
    zb, base = explore("zb-h1", p, m, tf=tf, tb=tb, tw=tw), explore("1f1b", p, m, tf=tf, tb=tb, tw=tw)
    assert zb.idle == pytest.approx([zb_h1_bubble(p, tf, tb, tw)] * p)
    assert base.idle == pytest.approx([(p - 1) * (tf + tb)] * p)
    if (tf, tb, tw) == (1, 2, 1):
        assert max(zb.idle) == pytest.approx(max(base.idle) / 3)


def test_zb_h1_never_holds_more_than_p_micro_batches():
    """Rank r: at most p - r forwards awaiting B plus at most r W's waiting: 1F1B's first-stage peak."""
    for p, m in [(4, 8), (8, 16), (3, 3)]:
        for ops in zb_h1(p, m).ops:
            held = peak = 0
            for op in ops:
                held += {F: 1, B: 0, W: -1}[op.kind]
                peak = max(peak, held)
            assert peak <= p
            assert all(ops.index(Op(W, i)) > ops.index(Op(B, i)) for i in range(m))


def test_p2p_latency_adds_to_the_critical_path():
    """AFAB: every forward and backward pipelines behind the first, so the latency of the p-1 hops down and
    the p-1 hops back is paid once: (m + p - 1)(t_f + t_b) + 2(p - 1)·latency. 1F1B alternates and pays more."""
    base, slow = explore("afab", 4, 8), explore("afab", 4, 8, p2p=0.5)
    assert slow.makespan == pytest.approx(base.makespan + 2 * 3 * 0.5)
    assert explore("1f1b", 4, 8, p2p=0.5).makespan > slow.makespan
    assert slow.p2p_messages == 2 * 3 * 8
    assert explore("interleaved", 4, 8, 2).p2p_messages == 2 * (4 * 2 - 1) * 8  # v times the messages


@pytest.mark.parametrize("call, message", [
    (lambda: make_schedule("gpipe", 4, 8), "schedule='gpipe' must be one of 'afab', '1f1b', 'interleaved', 'zb-h1', "
                                           "'zb-h2', 'dualpipe'"),
    (lambda: make_schedule("interleaved", 4, 6, 2), "microbatches=6 must be a multiple of pp=4"),
    (lambda: make_schedule("interleaved", 4, 8, 1), "chunks=1 must be >= 2 for the interleaved schedule"),
    (lambda: make_schedule("1f1b", 4, 8, 2), "chunks=2: only the interleaved schedule runs several chunks"),
    (lambda: make_schedule("1f1b", 0, 8), "pp=0 must be an integer >= 1"),
    (lambda: explore("1f1b", 4, 8, tf=-1), "tf=-1 must be a finite number >= 0"),
    (lambda: explore("zb-h1", 4, 8, tb=1, tw=2), "tw=2 must be <= tb=1"),
    (lambda: explore("1f1b", 4, 8, p2p=-0.1), "p2p=-0.1 must be a finite number >= 0"),
])
def test_bad_input_is_one_clear_line(call, message):
    with pytest.raises(ValueError) as info:
        call()
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_deadlocking_schedule_is_reported():
    from lab.calc.schedules import Schedule

    backwards_first = Schedule("broken", 2, 1, 1, ((Op(B, 0), Op(F, 0)), (Op(F, 0), Op(B, 0))))
    with pytest.raises(ValueError, match="deadlocks: ranks wait forever at"):
        simulate(backwards_first)
    assert interleaved(2, 2, 2).virtual_stages == 4


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 12), (6, 12), (8, 16), (8, 40)])
def test_dualpipe_runs_every_op_once_and_meets_the_papers_numbers(p, m):
    """DeepSeek-V3's Table 2: DualPipe idles (p/2-1)(F&B + B - 3W) for p+1 micro-batches of activations per
    rank (and twice the parameters); in the regime F = B = 2W, against 1F1B's (p-1)(F+B+W) and ZB-H1's."""
    schedule = make_schedule("dualpipe", p, m)
    half = m // 2
    for rank, ops in enumerate(schedule.ops):
        split = {(op.microbatch, op.chunk) for op in ops if op.kind == W}
        expected = [Op(k, i, c) for c in (0, 1) for i in range(c * half, (c + 1) * half) for k in (F, B)]
        assert sorted(op for op in ops if op.kind != W) == sorted(expected), rank
        assert all(ops.index(Op(W, i, c)) > ops.index(Op(B, i, c)) for i, c in split)
    tf, tb, tw = 2.0, 3.0, 1.0  # F = B (input gradient, t_b - t_w) = 2 W
    sim = simulate(schedule, tf, tb, tw)
    assert sim.idle == pytest.approx([dualpipe_bubble(p, tf, tb, tw)] * p)
    assert sim.peak_activations == [p + 1] * p
    if p >= 4:
        assert max(sim.idle) < max(explore("zb-h1", p, m, tf=tf, tb=tb, tw=tw).idle) < max(
            explore("1f1b", p, m, tf=tf, tb=tb, tw=tw).idle)


def test_dualpipe_shape_rules():
    with pytest.raises(ValueError, match="pp=3 must be even for dualpipe"):
        make_schedule("dualpipe", 3, 12)
    with pytest.raises(ValueError, match=r"microbatches=6 must be even and >= 2\*pp = 8 for dualpipe"):
        make_schedule("dualpipe", 4, 6)


@pytest.mark.parametrize("p, target, v", [(8, 0.05, 1), (4, 0.1, 1), (16, 0.05, 1), (8, 0.05, 4), (4, 0.3, 2),
                                          (22, 0.35, 1), (2, 2.0, 1)])
def test_min_microbatches_is_the_fewest_the_simulator_agrees_with(p, target, v):
    """The fewest m whose simulated 1F1B (or interleaved) bubble ratio is at most `target`: one fewer is above it
    (or, interleaved, the multiple of p below it). p = 8 at 5%: 7/m <= 0.05 from m = 140."""
    from lab.calc.bubble import min_microbatches

    m = min_microbatches(p, target, v)
    name = "interleaved" if v > 1 else "1f1b"
    assert explore(name, p, m, v).bubble_ratio <= target + 1e-12
    fewer = m - (p if v > 1 else 1)
    assert fewer < 1 or explore(name, p, fewer, v).bubble_ratio > target
    assert min_microbatches(8, 0.05) == 140


def test_boundary_bytes_is_what_the_simulated_messages_carry():
    """One micro-batch's (b, s, h) residual stream in bf16 per message, two messages per micro-batch and boundary:
    the simulator counts 2·m·(p − 1) messages in a 1F1B step."""
    from lab.calc.bubble import boundary_bytes

    assert boundary_bytes(1, 4096, 16384) == 4096 * 16384 * 2  # Llama 3 405B's d_model: 134 MB per message
    assert boundary_bytes(2, 4096, 8192, dtype_bytes=4, seq_shards=8) == 2 * 512 * 8192 * 4
    assert explore("1f1b", 4, 6).p2p_messages == 2 * 6 * 3


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 13), (8, 16), (8, 40)])
def test_zb_h2_leaves_no_bubble_inside_the_step_when_w_fills_it(p, m):
    """Qi et al. 2023, "Zero Bubble Pipeline Parallelism", §2.2: with T_F = T_B = T_W (t_f = t_b - t_w = t_w) ZB-H2
    turns 1F1B's trapezoid into a parallelogram — no rank idles between its first op and its last, for up to
    (2p - 1) micro-batches in flight (its Table 2's peak memory) — while ZB-H1 keeps p - 1 idle slots inside. The
    step's ends keep the fill offset (p - 1)·t_f, which the paper hides by overlapping consecutive steps."""
    from lab.calc.bubble import closed_form

    zb2, zb1 = explore("zb-h2", p, m, tf=1, tb=2, tw=1), explore("zb-h1", p, m, tf=1, tb=2, tw=1)
    assert max(zb2.interior_idle) == 0 < max(zb1.interior_idle) == p - 1
    assert max(zb2.peak_activations) == 2 * p - 1 and max(zb1.peak_activations) == p
    assert max(zb2.idle) == closed_form("zb-h2", p, m, tf=1, tb=2, tw=1)["idle"] == p - 1
    assert max(explore("zb-h2", p, m, tf=3, tb=6, tw=3).interior_idle) == 0  # any unit, same shape
    assert max(explore("zb-h2", p, m, tf=1, tb=2, tw=0.5).idle) < max(explore("zb-h1", p, m, tf=1, tb=2, tw=0.5).idle)


def test_the_group_knob_trades_activations_for_latency_slack():
    """Llama 3 (Dubey et al. 2024, §3.3.2, Figure 6) makes N, the micro-batches a rank runs through one chunk
    before the next, tunable between depth-first (N = p, Megatron's order) and breadth-first (N = m): the bubble
    without latency is the same (p − 1)/(v·m), a larger N holds more activations, and it absorbs a message
    latency that depth-first puts on the critical path. The figure's own case, p = 4, v = 2, N = 5, m = 10, is a
    batch depth-first cannot run (m not a multiple of p)."""
    p, m, v = 4, 16, 2
    assert interleaved(p, m, v, group=p).ops == interleaved(p, m, v).ops
    depth, breadth = (simulate(interleaved(p, m, v, group=n)) for n in (p, m))
    assert depth.bubble_ratio == pytest.approx(breadth.bubble_ratio) == pytest.approx(bubble_ratio(p, m, v))
    assert breadth.peak_activations[0] > depth.peak_activations[0]
    slow_depth, slow_breadth = (simulate(interleaved(p, m, v, group=n), p2p=0.3) for n in (p, m))
    assert slow_breadth.bubble_ratio < slow_depth.bubble_ratio
    llama = simulate(interleaved(4, 10, 2, group=5))
    assert llama.bubble_ratio == pytest.approx(bubble_ratio(4, 10, 2))
    with pytest.raises(ValueError, match="microbatches=10 must be a multiple of pp=4"):
        interleaved(4, 10, 2)
    with pytest.raises(ValueError, match="group=3 micro-batches per chunk must be from pp=4 to microbatches=10"):
        interleaved(4, 10, 2, group=3)
