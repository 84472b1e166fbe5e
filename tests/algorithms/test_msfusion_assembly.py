"""MSfusion's assembled full model (Algorithm 1, "Global Model Combination"): built from the current round's
sub-models only.  Hand-computed cases: which entry comes from which sub-model, entries nobody holds this round,
stale entries (held earlier) vs never-held ones, BatchNorm buffers and ``num_batches_tracked``, the
``fallback=combined`` base of a participant's Eq. 5, and the algorithm's own server step."""

import pytest
import torch

from fedfuse.algorithms.msfusion import ASSEMBLIES, assemble
from fedfuse.fusion.slicing import combine, fill_unheld, slice_spec, slice_state
from fedfuse.models import build_model
from fedfuse.types import Message

torch.set_num_threads(1)


def _mlp():
    torch.manual_seed(0)
    m = build_model("mlp", (3,), 2, task="classification", widths=[4, 4])
    return m, slice_spec(m), {k: v.clone() for k, v in m.state_dict().items()}


def _filled(state, value):
    return {k: torch.full_like(v, float(value)) for k, v in state.items()}


def _round(latest, spec, sources, ever=None):
    shapes = {k: tuple(v.shape) for k, v in latest.items()}
    new, counts = combine(latest, spec.full_selection(), spec, shapes, sources)
    ever = {k: (ever or {}).get(k, torch.zeros(v.shape, dtype=torch.bool)) | (counts[k] > 0)
            for k, v in new.items()}
    return new, counts, ever


def test_current_assembly_by_hand():
    """Two sub-models of a 3-4-4-2 MLP: A holds units {0,1} of both hidden layers (value 2), B {1,2} (value 4).
    Unit 3 is held by nobody; hidden.1 entries (row, col) with row and col in different windows, e.g. (0, 2),
    are held by nobody either (off-block)."""
    _, spec, w0 = _mlp()
    sa = {"hidden.0": torch.tensor([0, 1]), "hidden.1": torch.tensor([0, 1])}
    sb = {"hidden.0": torch.tensor([1, 2]), "hidden.1": torch.tensor([1, 2])}
    a, b = _filled(slice_state(w0, spec, sa), 2.0), _filled(slice_state(w0, spec, sb), 4.0)
    latest, counts, ever = _round(w0, spec, [(a, sa), (b, sb)])
    g = assemble(latest, counts, ever, w0, "current")
    # hidden.0: rows (units) 0 from A, 1 averaged, 2 from B, 3 nobody -> 0; every input column is unsplit
    assert g["hidden.0.weight"].tolist() == [[2.0] * 3, [3.0] * 3, [4.0] * 3, [0.0] * 3]
    assert g["hidden.0.bias"].tolist() == [2.0, 3.0, 4.0, 0.0]
    expect = torch.tensor([[2.0, 2.0, 0.0, 0.0],   # row 0: A holds cols 0,1; (0,2) off-block -> 0
                           [2.0, 3.0, 4.0, 0.0],   # row 1: (1,0) A only, (1,1) both, (1,2) B only
                           [0.0, 4.0, 4.0, 0.0],   # row 2: (2,0) off-block -> 0
                           [0.0, 0.0, 0.0, 0.0]])  # row 3 / col 3: unit nobody holds
    assert torch.equal(g["hidden.1.weight"], expect)
    assert g["fc.weight"].tolist() == [[2.0, 3.0, 4.0, 0.0]] * 2  # head columns follow hidden.1
    assert g["fc.bias"].tolist() == [3.0, 3.0]  # unsplit: both hold it
    # the earlier reading keeps W0 (never trained) where the current one has 0
    last = assemble(latest, counts, ever, w0, "last")
    assert last["hidden.1.weight"][0, 2] == w0["hidden.1.weight"][0, 2]
    assert last["hidden.0.bias"][3] == w0["hidden.0.bias"][3]
    assert torch.equal(last["hidden.1.weight"][1, 1], torch.tensor(3.0))


def test_stale_entries_zero_stale_and_last():
    """Round 1: A holds {0,1} (value 2).  Round 2: B alone holds {2,3} (value 4).  Units 0,1 are stale in round 2:
    current -> 0, zero_stale -> 0, last -> A's round-1 value 2.  Entries never held (e.g. hidden.1 (0, 3)):
    current -> 0, zero_stale -> W0, last -> W0."""
    _, spec, w0 = _mlp()
    sa = {"hidden.0": torch.tensor([0, 1]), "hidden.1": torch.tensor([0, 1])}
    sb = {"hidden.0": torch.tensor([2, 3]), "hidden.1": torch.tensor([2, 3])}
    latest, _, ever = _round(w0, spec, [(_filled(slice_state(w0, spec, sa), 2.0), sa)])
    latest, counts, ever = _round(latest, spec, [(_filled(slice_state(w0, spec, sb), 4.0), sb)], ever)
    cur, zs, last = (assemble(latest, counts, ever, w0, m) for m in ("current", "zero_stale", "last"))
    w = "hidden.1.weight"
    assert cur[w][0, 0] == 0 and zs[w][0, 0] == 0 and last[w][0, 0] == 2.0  # stale (held in round 1)
    assert cur[w][0, 3] == 0 and zs[w][0, 3] == w0[w][0, 3] and last[w][0, 3] == w0[w][0, 3]  # never held
    assert cur[w][3, 3] == zs[w][3, 3] == last[w][3, 3] == 4.0  # held now: B's value in every reading
    assert cur["hidden.0.bias"].tolist() == [0.0, 0.0, 4.0, 4.0]
    assert last["hidden.0.bias"].tolist() == [2.0, 2.0, 4.0, 4.0]
    assert cur["fc.weight"][:, :2].abs().sum() == 0 and zs["fc.weight"][:, :2].abs().sum() == 0
    # the latest state is the 'last' reading (what fallback=combined splits from)
    assert torch.equal(latest[w], last[w])


def test_bn_buffers_and_num_batches_tracked():
    """ResNet stem (4 channels): A holds channels {0,1}, B {1,2}; channel 3 nobody.  Running mean averaged over
    holders, the uncovered channel's running variance 1 and weight/bias/mean 0; num_batches_tracked = max."""
    torch.manual_seed(0)
    m = build_model("resnet18", (3, 8, 8), 5, task="classification", width_mult=0.0625)
    spec = slice_spec(m)
    w0 = {k: v.clone() for k, v in m.state_dict().items()}
    s1 = {g: torch.arange(k)[:2] for g, k in spec.groups.items()}
    s2 = {g: torch.arange(k)[1:3] for g, k in spec.groups.items()}
    a, b = slice_state(w0, spec, s1), slice_state(w0, spec, s2)
    a["bn1.running_mean"], b["bn1.running_mean"] = torch.tensor([1.0, 3.0]), torch.tensor([5.0, 7.0])
    a["bn1.running_var"], b["bn1.running_var"] = torch.tensor([2.0, 2.0]), torch.tensor([4.0, 6.0])
    a["bn1.num_batches_tracked"], b["bn1.num_batches_tracked"] = torch.tensor(3), torch.tensor(11)
    latest, counts, ever = _round(w0, spec, [(a, s1), (b, s2)])
    g = assemble(latest, counts, ever, w0, "current")
    assert g["bn1.running_mean"].tolist() == [1.0, 4.0, 7.0, 0.0]
    assert g["bn1.running_var"].tolist() == [2.0, 3.0, 6.0, 1.0]
    assert g["bn1.weight"][3] == 0 and g["bn1.bias"][3] == 0
    assert g["bn1.num_batches_tracked"].item() == 11 and g["bn1.num_batches_tracked"].dtype == torch.long
    # every tensor keeps its dtype and shape; the assembled model loads and runs
    assert all(g[k].dtype == w0[k].dtype and g[k].shape == w0[k].shape for k in w0)
    m.load_state_dict(g)
    assert torch.isfinite(m.eval()(torch.randn(2, 3, 8, 8))).all()


def test_fill_unheld_with_explicit_fill():
    _, _spec, w0 = _mlp()
    counts = {k: torch.zeros(v.shape, dtype=torch.long) for k, v in w0.items()}
    counts["fc.bias"][0] = 1
    out = fill_unheld(w0, counts, {k: torch.full_like(v, 7.0) for k, v in w0.items()})
    assert out["fc.bias"][0] == w0["fc.bias"][0] and out["fc.bias"][1] == 7.0


def test_unknown_assembly_is_an_error():
    _, _spec, w0 = _mlp()
    counts = {k: torch.ones(v.shape, dtype=torch.long) for k, v in w0.items()}
    with pytest.raises(ValueError, match="assembly"):
        assemble(w0, counts, {}, w0, "newest")
    assert ASSEMBLIES == ("current", "zero_stale", "last")


# ---- the algorithm's own steps ------------------------------------------------------------------------------
def _exp(rounds=3, **opts):
    from fedfuse.config import RunConfig, apply
    from fedfuse.runner import experiment

    base = dict(dataset="digits", partition="shards", partition_options={"classes_per_client": 5}, model="mlp",
                clients=4, clients_per_round=4, rounds=rounds, eval_every=1, batch_size=64, local_epochs=1,
                lr=0.05, seed=2, plots=False, out=None, model_options={"widths": [8, 8]}, algorithm="msfusion",
                dataset_options={"train_limit": 300, "test_limit": 100},
                algorithm_options={"mu": 0.25, "lr_schedule": "constant", **opts})
    return experiment(apply(RunConfig(), base))


def _reference_current(algo, states):
    """Explicit reference: every element the mean of the final-round sub-models holding it, else 0 (BN var 1)."""
    from fedfuse.fusion.slicing import dim_indices

    out = {}
    for key, shape in algo.shapes.items():
        total = torch.zeros(shape, dtype=torch.float64)
        count = torch.zeros(shape)
        for st in states.values():
            pos = dim_indices(algo.spec, st["sel"], key, shape)
            for flat, val in enumerate(st["sub"][key].reshape(-1).tolist()):
                idx = []
                rem = flat
                for d in reversed(range(len(pos))):
                    idx.append(int(pos[d][rem % pos[d].numel()]))
                    rem //= pos[d].numel()
                idx = tuple(reversed(idx))
                total[idx] += val
                count[idx] += 1
        out[key] = torch.where(count > 0, total / count.clamp_min(1), torch.zeros(())).float()
    return out


def test_run_evaluates_the_current_round_assembly():
    """After a real 3-round run (MLP 8-8, 4 participants, μ = 0.25, so every hidden→hidden matrix has entries
    no participant holds): the server's global model equals the explicit per-element mean of the last round's
    sub-models, 0 elsewhere; it is what the run evaluated and what compare_assemblies reports as 'current'."""
    exp = _exp(compare_assemblies=True)
    exp.run()
    algo, states = exp.algo, {c: exp.client_states[c] for c in range(4)}
    glob = algo.global_model(exp.state)[0]
    ref = _reference_current(algo, states)
    for k in glob:
        torch.testing.assert_close(glob[k], ref[k], rtol=1e-6, atol=1e-7)
    w = glob["hidden.1.weight"]
    assert (w == 0).sum() > 0 and (exp.state["latest"]["hidden.1.weight"] != 0).all()
    last = exp.history[-1]
    assert last["global_accuracy_current"] == last["global_accuracy"]
    assert {"global_accuracy_last", "global_accuracy_zero_stale"} <= set(last)


def test_assembly_changes_evaluation_only():
    """The assembly is evaluation (and fetch) only: the participants' trained sub-models are identical."""
    runs = []
    for mode in ("current", "last"):
        e = _exp(assembly=mode)
        e.run()
        runs.append(e)
    for c in range(4):
        for k, v in runs[0].client_states[c]["sub"].items():
            assert torch.equal(v, runs[1].client_states[c]["sub"][k])
    assert runs[0].history[-1]["train_loss"] == runs[1].history[-1]["train_loss"]
    g_cur, g_last = (r.algo.global_model(r.state)[0] for r in runs)
    assert not torch.equal(g_cur["hidden.1.weight"], g_last["hidden.1.weight"])
    torch.testing.assert_close(g_last["hidden.1.weight"], runs[0].state["latest"]["hidden.1.weight"])


def test_fallback_combined_takes_the_latest_combined_value():
    """Participant 0 in round 3 with no mail: elements it held in round 2 keep its own trained values; the others
    come from the latest combined model (fallback=combined) or its own memory / W0 (fallback=memory), and the
    fetched ones are counted as bytes."""
    exp = _exp(rounds=3, fallback="combined")
    exp._fresh()
    for r in range(2):
        exp._round(r)
    algo, state = exp.algo, exp.client_states[0]
    info = type("I", (), {"index": 2, "total": 3})()
    payload = algo.configure_fit(exp.state, info, [0])[0]
    latest = {k[len("sim/latest/"):]: v for k, v in payload.tensors.items() if k.startswith("sim/latest/")}
    assert latest and set(latest) == set(algo.shapes)
    alone = Message({f"sim/latest/{k}": v for k, v in latest.items()}, {"senders": []})
    w_star, sel, fallback, fetched = algo.aggregate_local(0, 2, 3, state, alone)
    prev = state["sel"]
    from_latest = 0
    for key in ("hidden.0.bias", "hidden.1.bias"):
        g = key.split(".bias")[0]
        for i, unit in enumerate(sel[g].tolist()):
            if unit in prev[g].tolist():
                assert w_star[key][i] == state["sub"][key][prev[g].tolist().index(unit)]
            else:
                assert w_star[key][i] == latest[key][i]
                from_latest += 1
    assert from_latest > 0
    assert fallback > 0 and fetched == 4 * fallback  # float32 elements
    mem = _exp(rounds=3)
    mem._fresh()
    for r in range(2):
        mem._round(r)
    w_mem, *_ = mem.algo.aggregate_local(0, 2, 3, mem.client_states[0], Message({}, {"senders": []}))
    known = slice_state(mem.client_states[0]["known"], mem.algo.spec, sel)
    new = [u for u in sel["hidden.0"].tolist() if u not in prev["hidden.0"].tolist()]
    assert new and all(w_mem["hidden.0.bias"][sel["hidden.0"].tolist().index(u)]
                       == known["hidden.0.bias"][sel["hidden.0"].tolist().index(u)] for u in new)


def test_fallback_combined_needs_the_assembled_model():
    with pytest.raises(ValueError, match="fallback=combined"):
        _exp(fallback="combined", global_model="none")._fresh()


def test_fallback_combined_bytes_reach_the_round_total():
    exp = _exp(rounds=3, fallback="combined")
    exp.run()
    h = exp.history
    plain = _exp(rounds=3)
    plain.run()
    extra = [a["bytes_peer"] - b["bytes_peer"] for a, b in zip(h, plain.history)]
    assert extra[0] == 0  # round 0: everyone starts from the common W0, nothing fetched
    assert sum(extra) == sum(int(r["fallback_bytes_per_participant"] * 4) for r in h)


def test_transformer_with_full_coverage_assembles_the_same_in_every_reading():
    """No transformer tensor is sliced along two unit groups (Q/K/V and the first feed-forward layer by rows,
    out_proj and the second by columns), so every element belongs to one unit or to none: with every unit held
    (coverage 1, as in the PTB preset: μN = 2.5 ≥ c), all three assemblies give the same model."""
    from fedfuse.algorithms.msfusion import assemble
    from fedfuse.fusion.slicing import dss_indices

    torch.manual_seed(0)
    m = build_model("transformer", (6,), 30, task="lm", vocab_size=30, d_model=8, n_heads=2, d_ff=12, dropout=0.0)
    spec = slice_spec(m)
    assert all(sum(d is not None for d in dims) <= 1 for dims in spec.dims.values())
    w0 = {k: v.clone() for k, v in m.state_dict().items()}
    shapes = {k: tuple(v.shape) for k, v in w0.items()}
    sels = [{g: dss_indices(k, 0.25, n, 10, 1.0, 3) for g, k in spec.groups.items()} for n in range(10)]
    gen = torch.Generator().manual_seed(1)
    subs = [({k: torch.randn(v.shape, generator=gen) for k, v in slice_state(w0, spec, s).items()}, s) for s in sels]
    latest, counts = combine(w0, spec.full_selection(), spec, shapes, subs)
    ever = {k: c > 0 for k, c in counts.items()}
    assert all(bool((c > 0).all()) for c in counts.values())  # coverage 1
    cur, zs, last = (assemble(latest, counts, ever, w0, mode) for mode in ("current", "zero_stale", "last"))
    for k in w0:
        assert torch.equal(cur[k], last[k]) and torch.equal(zs[k], last[k])
