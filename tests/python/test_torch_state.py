#!/usr/bin/python3
"""An optimizer group's state in torch.optim.AdamW's state_dict form, both
ways (qtx.Client.optimizer_state_dict / load_optimizer_state_dict, issue 19),
against a CPU qtxd and Debian's python3-torch:

* torch -> qtx: torch.optim.AdamW (two param groups, different weight decay
  and lr) runs two steps; its state_dict loaded into qtx gives the same
  masters, moments and step bit for bit, and per-parameter settings; then
  qtx and torch run three more steps on the same gradients: qtx equals, bit
  for bit, the numpy AdamW of kernels/adamw.h's operation order started from
  torch's state, and torch within the tolerance below;
* qtx -> torch: a qtx group with per-parameter weight decay and lr scale runs
  two steps; torch.optim.AdamW built from the exported param groups loads the
  exported dict and continues: the same masters as qtx continuing, within the
  tolerance (and qtx bit for bit with numpy from the exported state);
* round trips are exact: export -> import -> export gives equal dicts (bits,
  dtypes, groups), also through torch (qtx -> torch.load_state_dict ->
  torch.state_dict() -> qtx -> export), with BF16 moments and a skipped step;
* a fresh torch optimizer (no state) imports as step 0; what cannot be
  mapped (AMSGrad, maximize, Adam's coupled decay, betas differing between
  groups, state for some parameters only, no names, a group without bias
  correction) raises ValueError naming it.

Tolerance (qtx vs torch, masters after 3 steps from a common state): |qtx -
torch| <= 2e-6 * |torch| + 2e-7, as tests/python/test_optimizer.py uses.
Both compute torch.optim.AdamW's formula in FP32 from the same state; they
differ only in rounding. qtx rounds every operation separately in the order
of kernels/adamw.h (docs: proto/qtx/v1/optimizer.proto) and computes the
update as (step_size * m) / denom; torch 1.13 computes m / denom, then
multiplies by -step_size inside addcdiv_, and its vectorized CPU kernels may
fuse multiply-adds in the moment updates. Each step thus differs by at most a
few units in the last place (ulp, 2^-23 relative) of the update term and one
ulp of the parameter in the final subtraction; the moments differ by an ulp
or so and feed later steps. Over 3 steps that is well under 16 ulps (2e-6
relative); 2e-7 absolute covers parameters near zero, where the update term
(about lr = 1e-2, ulp 1e-9) dominates. A wrong step count, moment or
hyper-parameter moves the masters by far more (the bias correction alone
changes the first updates by tens of percent), and the bit-exact comparison
with numpy checks the imported state exactly.

  /usr/bin/python3 tests/python/test_torch_state.py --qtxd=build/server/qtxd \\
      --python_dir=build/client/python
Exits 77 (CTest: skipped) when torch is not importable.
"""

import argparse
import os
import sys
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_client_optimizer as base  # noqa: E402  (qtxd start/stop, the numpy AdamW)

ARGS = None
qtx = torch = None
LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.1
RTOL, ATOL = 2e-6, 2e-7
SHAPES = {"w1": (130, 200), "b1": (130,), "w2": (64, 128)}


def setUpModule():
    base.ARGS, base.qtx = ARGS, qtx
    base.setUpModule()


def tearDownModule():
    base.tearDownModule()


def grads_for(rng, k):
    return [{n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
            for _ in range(k)]


def numpy_continue(state, grads, first_t, settings):
    """The numpy AdamW (kernels/adamw.h's order) from {name: (p, m, v)} for
    len(grads) steps numbered first_t, ...; settings: {name: (lr, wd)}."""
    state = {n: tuple(np.array(a, dtype=np.float32) for a in pmv) for n, pmv in state.items()}
    for k, g in enumerate(grads):
        for n, (p, m, v) in state.items():
            lr, wd = settings[n]
            s = base.adamw_scalars(lr, BETAS, EPS, wd, first_t + k, 1.0)
            state[n] = base.adamw_update(p, m, v, g[n], s)
    return {n: pmv[0] for n, pmv in state.items()}


def f32(t):
    """A torch tensor (any float dtype) as numpy float32."""
    return t.detach().float().numpy()


class TorchStateTest(unittest.TestCase):
    def setUp(self):
        self.c = qtx.Client(base.SERVER["target"], timeout=60)
        self.rng = np.random.default_rng(19)
        self.init = {n: (self.rng.standard_normal(s) * 0.1).astype(np.float32)
                     for n, s in SHAPES.items()}

    def tearDown(self):
        for g in self.c.list_optimizer_groups().groups:
            self.c.release_group(g.name)
        self.c.close()

    # -- helpers

    assert_bits_equal = base.OptimizerClientTest.assert_bits_equal  # same shape, dtype, bits

    def assert_same(self, got, want, path="sd"):
        """Equal structure, keys, values; tensors equal in dtype, shape and bits."""
        if isinstance(want, torch.Tensor):
            self.assertIsInstance(got, torch.Tensor, path)
            self.assertEqual((got.dtype, tuple(got.shape)), (want.dtype, tuple(want.shape)), path)
            ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
            size = want.element_size()
            self.assertTrue(torch.equal(got.contiguous().view(ints[size]),
                                        want.contiguous().view(ints[size])), path)
        elif isinstance(want, dict):
            self.assertIsInstance(got, dict, path)
            self.assertEqual(sorted(got, key=str), sorted(want, key=str), path)
            for k in want:
                self.assert_same(got[k], want[k], "%s[%r]" % (path, k))
        elif isinstance(want, (list, tuple)):
            self.assertEqual((type(got), len(got)), (type(want), len(want)), path)
            for i, (a, b) in enumerate(zip(got, want)):
                self.assert_same(a, b, "%s[%d]" % (path, i))
        else:
            self.assertEqual((type(got), got), (type(want), want), path)

    def assert_close_to_torch(self, qtx_masters, tparams, msg):
        for n, p in tparams.items():
            np.testing.assert_allclose(qtx_masters[n], f32(p), rtol=RTOL, atol=ATOL,
                                       err_msg="%s: %s" % (msg, n))

    def qtx_masters(self, group):
        return {n: p.master for n, p in self.c.get_state(group).parameters.items()}

    def torch_from_export(self, sd):
        """torch.optim.AdamW over parameters made from the export's master
        weights, its param groups as the export lays them out, then
        load_state_dict(sd). Returns ({name: Parameter}, optimizer)."""
        params, groups = {}, []
        for pg in sd["param_groups"]:
            ps = []
            for i, n in zip(pg["params"], pg["param_names"]):
                params[n] = torch.nn.Parameter(sd["master_weights"][i].clone())
                ps.append(params[n])
            groups.append({"params": ps, "lr": 1.0, "weight_decay": 0.5})  # overwritten by load
        topt = torch.optim.AdamW(groups, lr=1.0, betas=(0.5, 0.5), eps=1.0)
        topt.load_state_dict(sd)
        return params, topt

    def torch_steps(self, tparams, topt, grads):
        for g in grads:
            for n, p in tparams.items():
                p.grad = torch.from_numpy(g[n].copy())
            topt.step()

    def qtx_steps(self, group, first, grads):
        for k, g in enumerate(grads):
            r = self.c.step(group, first + k, g, omit_parameters=True)
            self.assertFalse(r.stats.skipped)

    # -- tests

    def test_torch_to_qtx(self):
        tparams = {n: torch.nn.Parameter(torch.from_numpy(a.copy())) for n, a in self.init.items()}
        topt = torch.optim.AdamW(
            [{"params": [tparams["w1"], tparams["w2"]]},
             {"params": [tparams["b1"]], "weight_decay": 0.0, "lr": LR * 0.5}],
            lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        grads = grads_for(self.rng, 5)
        self.torch_steps(tparams, topt, grads[:2])
        sd = topt.state_dict()
        self.assertNotIn("param_names", sd["param_groups"][0])  # torch 1.13: by order only
        order = [("w1", tparams["w1"]), ("w2", tparams["w2"]), ("b1", tparams["b1"])]
        info = self.c.load_optimizer_state_dict("from-torch", sd, parameters=order)
        self.assertEqual((info.step, info.update_count, info.num_parameters), (2, 2, 3))
        self.assertEqual((info.hyper_params.lr, info.hyper_params.betas, info.hyper_params.eps,
                          info.hyper_params.weight_decay), (LR, BETAS, EPS, WD))
        self.assertEqual(info.parameter_hyper_params, {"b1": (0.0, 0.5)})
        st = self.c.get_state("from-torch", include_moments=True)
        self.assertEqual(list(st.parameters), ["w1", "w2", "b1"])  # torch's parameter order
        start = {}
        for n, p in tparams.items():
            ts = topt.state[p]
            got = st.parameters[n]
            for a, b in ((got.master, p), (got.exp_avg, ts["exp_avg"]),
                         (got.exp_avg_sq, ts["exp_avg_sq"])):
                self.assert_bits_equal(a, f32(b), n)
            start[n] = (got.master, got.exp_avg, got.exp_avg_sq)
        # Both continue on the same gradients.
        self.qtx_steps("from-torch", 3, grads[2:])
        self.torch_steps(tparams, topt, grads[2:])
        masters = self.qtx_masters("from-torch")
        want = numpy_continue(start, grads[2:], 3, {"w1": (LR, WD), "w2": (LR, WD),
                                                    "b1": (LR * 0.5, 0.0)})
        for n in SHAPES:
            self.assert_bits_equal(masters[n], want[n], "numpy " + n)
        self.assert_close_to_torch(masters, tparams, "qtx vs torch after the import")

    def test_qtx_to_torch(self):
        self.c.offload_optimizer_state("to-torch", self.init, lr=LR, betas=BETAS, eps=EPS,
                                       weight_decay=WD, weight_decays={"b1": 0.0},
                                       lr_scales={"w2": 0.25})
        grads = grads_for(self.rng, 5)
        self.qtx_steps("to-torch", 1, grads[:2])
        sd = self.c.optimizer_state_dict("to-torch")
        # One torch group per distinct (weight_decay, lr_scale), in order of first appearance.
        self.assertEqual([(pg["param_names"], pg["params"], pg["lr"], pg["weight_decay"],
                           pg["lr_scale"]) for pg in sd["param_groups"]],
                         [(["w1"], [0], LR, WD, 1.0), (["b1"], [1], LR, 0.0, 1.0),
                          (["w2"], [2], LR * 0.25, WD, 0.25)])
        for pg in sd["param_groups"]:
            self.assertEqual((pg["betas"], pg["eps"], pg["amsgrad"], pg["maximize"]),
                             (BETAS, EPS, False, False))
        self.assertEqual(sd["qtx"], {"lr": LR, "weight_decay": WD})
        st = self.c.get_state("to-torch", include_moments=True)
        for pg in sd["param_groups"]:
            (i,), (n,) = pg["params"], pg["param_names"]
            self.assertEqual(sd["state"][i]["step"].dtype, torch.float32)
            self.assertEqual(float(sd["state"][i]["step"]), 2.0)
            self.assert_bits_equal(f32(sd["master_weights"][i]),
                                                       st.parameters[n].master, n)
            self.assert_bits_equal(f32(sd["state"][i]["exp_avg"]),
                                                       st.parameters[n].exp_avg, n)
        tparams, topt = self.torch_from_export(sd)
        self.assertEqual([(g["lr"], g["weight_decay"], g["betas"], g["eps"])
                          for g in topt.param_groups],
                         [(LR, WD, BETAS, EPS), (LR, 0.0, BETAS, EPS),
                          (LR * 0.25, WD, BETAS, EPS)])
        for pg in sd["param_groups"]:
            (i,), (n,) = pg["params"], pg["param_names"]
            self.assert_same(topt.state[tparams[n]], sd["state"][i], "torch state " + n)
        start = {n: (p.master, p.exp_avg, p.exp_avg_sq) for n, p in st.parameters.items()}
        self.qtx_steps("to-torch", 3, grads[2:])
        self.torch_steps(tparams, topt, grads[2:])
        masters = self.qtx_masters("to-torch")
        want = numpy_continue(start, grads[2:], 3, {"w1": (LR, WD), "b1": (LR, 0.0),
                                                    "w2": (LR * 0.25, WD)})
        for n in SHAPES:
            self.assert_bits_equal(masters[n], want[n], "numpy " + n)
        self.assert_close_to_torch(masters, tparams, "torch continuing qtx's export")

    def test_round_trips_are_exact(self):
        # BF16 moments, an lr scale that is not a power of two, a skipped step.
        self.c.offload_optimizer_state("rt-a", self.init, lr=LR, betas=BETAS, eps=EPS,
                                       weight_decay=WD, moment_dtype="bfloat16",
                                       weight_decays={"b1": 0.0}, lr_scales={"w2": 0.3})
        grads = grads_for(self.rng, 3)
        self.c.step("rt-a", 1, grads[0])
        self.c.step("rt-a", 2, grads[1], skip=True)
        self.c.step("rt-a", 3, grads[2])
        a = self.c.list_optimizer_groups().groups[0]
        self.assertEqual((a.step, a.update_count), (3, 2))
        sd1 = self.c.optimizer_state_dict("rt-a")
        self.assertEqual(sd1["state"][0]["exp_avg"].dtype, torch.bfloat16)
        self.assertEqual(float(sd1["state"][0]["step"]), 2.0)  # AdamW's t, not qtx's step 3
        info = self.c.load_optimizer_state_dict("rt-b", sd1, moment_dtype="bfloat16")
        # The imported group's step counter is torch's step: the next step() carries 3.
        self.assertEqual((info.step, info.update_count), (2, 2))
        self.assertEqual(info.parameter_hyper_params, {"b1": (0.0, 1.0), "w2": (WD, 0.3)})
        self.assert_same(self.c.optimizer_state_dict("rt-b"), sd1)
        # Through torch: its state_dict() keeps the group keys, drops master_weights and qtx.
        tparams, topt = self.torch_from_export(sd1)
        tsd = topt.state_dict()
        self.assertNotIn("master_weights", tsd)
        self.assertEqual(tsd["state"][0]["exp_avg"].dtype, torch.float32)  # cast to the param's
        self.c.load_optimizer_state_dict("rt-c", tsd, parameters=tparams, moment_dtype="bfloat16")
        self.assert_same(self.c.optimizer_state_dict("rt-c"), sd1)
        # Both continue identically (same state, same arithmetic).
        ra = self.c.step("rt-a", 4, grads[0])
        rb = self.c.step("rt-b", 3, grads[0])
        for n in SHAPES:
            self.assertEqual(ra.parameters[n].fp8.rowwise_data.tobytes(),
                             rb.parameters[n].fp8.rowwise_data.tobytes(), n)
        ma, mb = self.qtx_masters("rt-a"), self.qtx_masters("rt-b")
        for n in SHAPES:
            self.assert_bits_equal(mb[n], ma[n], "continued " + n)

    def test_fresh_torch_optimizer(self):
        tparams = {n: torch.nn.Parameter(torch.from_numpy(a.copy())) for n, a in self.init.items()}
        topt = torch.optim.AdamW(list(tparams.values()), lr=LR, betas=BETAS, eps=EPS,
                                 weight_decay=WD)
        info = self.c.load_optimizer_state_dict("fresh", topt.state_dict(),
                                                parameters=tparams)
        self.assertEqual((info.step, info.update_count, info.parameter_hyper_params),
                         (0, 0, {}))
        st = self.c.get_state("fresh", include_moments=True)
        for n, p in st.parameters.items():
            self.assertFalse(p.exp_avg.any() or p.exp_avg_sq.any(), n)
        grads = grads_for(self.rng, 2)
        self.qtx_steps("fresh", 1, grads)
        self.torch_steps(tparams, topt, grads)
        self.assert_close_to_torch(self.qtx_masters("fresh"), tparams, "from a fresh optimizer")

    def test_what_cannot_be_mapped(self):
        tparams = {n: torch.nn.Parameter(torch.from_numpy(a.copy())) for n, a in self.init.items()}
        named = list(tparams.items())

        def sd_of(groups, steps=1, **kw):
            topt = torch.optim.AdamW(groups, lr=LR, **kw)
            self.torch_steps(tparams, topt, grads_for(self.rng, steps))
            return topt.state_dict()

        cases = [
            (sd_of(list(tparams.values()), amsgrad=True), named, "amsgrad=True"),
            (sd_of(list(tparams.values()), maximize=True), named, "maximize=True"),
            (sd_of([{"params": [tparams["w1"], tparams["b1"]]},
                    {"params": [tparams["w2"]], "betas": (0.8, 0.999)}]), named, "betas="),
            (sd_of(list(tparams.values())), None, "param_names"),
            (sd_of(list(tparams.values())), named[:2], "2 parameter names"),
        ]
        # State for two parameters only (w2 had no gradient).
        topt = torch.optim.AdamW(list(tparams.values()), lr=LR)
        for n in ("w1", "b1"):
            tparams[n].grad = torch.ones_like(tparams[n])
        tparams["w2"].grad = None
        topt.step()
        cases.append((topt.state_dict(), named, "['w2'] have no optimizer state"))
        coupled = sd_of(list(tparams.values()))
        coupled["param_groups"][0]["decoupled_weight_decay"] = False  # torch.optim.Adam's form
        cases.append((coupled, named, "decoupled_weight_decay=False"))
        cases.append(({"state": {}}, named, "needs 'state' and 'param_groups'"))
        for sd, params, text in cases:
            with self.assertRaises(ValueError) as cm:
                self.c.load_optimizer_state_dict("bad", sd, parameters=params)
            self.assertIn(text, str(cm.exception))
        self.assertEqual(self.c.list_optimizer_groups().groups, [])  # nothing was offloaded
        with self.assertRaises(TypeError) as cm:
            self.c.load_optimizer_state_dict("bad", coupled, parameters=named, lr=1.0)
        self.assertIn("['lr']", str(cm.exception))
        self.c.offload_optimizer_state("no-bc", self.init, bias_correction=False)
        with self.assertRaises(ValueError) as cm:
            self.c.optimizer_state_dict("no-bc")
        self.assertIn("bias_correction=False", str(cm.exception))


if __name__ == "__main__":
    try:  # module globals, as the tests use them
        import torch
    except ImportError:
        print("SKIP: torch is not importable (Debian: apt-get install python3-torch)")
        sys.exit(77)
    torch.set_num_threads(1)
    p = argparse.ArgumentParser()
    for flag in ("--qtxd", "--python_dir"):
        p.add_argument(flag, required=True)
    ARGS, rest = p.parse_known_args()
    sys.path.insert(0, ARGS.python_dir)
    import qtx
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)
