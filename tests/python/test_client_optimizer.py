#!/usr/bin/python3
"""qtx.Client's Optimizer calls against a qtxd (--device=cpu, with a
checkpoint directory).

* the master weights after each step equal, bit for bit, an AdamW written
  here in numpy FP32 in the operation order of kernels/adamw.h (scalars
  rounded once from double; per element separate FP32 multiply / add / sqrt /
  divide), including clipping, a per-step lr, a skipped non-finite step and
  BF16-stored moments;
* the FP8 parameters step() returns equal client.quantize() of the master
  weights fetched with get_state, byte for byte;
* a retried step number replays the same result; a stale or future step raises
  FailedPreconditionError naming the group's step;
* BF16 output, initial moments and step, save/load checkpoint, release_group
  and list_optimizer_groups; argument errors;
* two-phase steps over two groups (grad_norm, then step with the global
  clip_factor / skip) equal the numpy AdamW with that factor;
* per-parameter weight decay and lr scale equal the numpy AdamW with each
  parameter's own settings.

  /usr/bin/python3 tests/python/test_client_optimizer.py --qtxd=build/server/qtxd \\
      --python_dir=build/client/python
"""

import argparse
import math
import os
import shutil
import sys
import tempfile
import unittest

import numpy as np

import qtxd_child

ARGS = None
qtx = None
SERVER = {}

F32 = np.float32
SHAPES = {"w1": (130, 200), "w2": (64, 128)}
LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.1


def setUpModule():
    tmp = tempfile.mkdtemp(prefix="qtx-pyopt-")
    SERVER["tmp"] = tmp
    SERVER["ckpt"] = os.path.join(tmp, "ckpt")

    def serving(target):
        with qtx.Client(target, timeout=2) as c:
            return c.health() == "SERVING"
    child = qtxd_child.start(ARGS.qtxd, tmp, ["--device=cpu", "--checkpoint_dir=" + SERVER["ckpt"]],
                             probe=serving)
    SERVER["child"] = child
    SERVER["target"] = child.target


def tearDownModule():
    child = SERVER.get("child")
    if child is not None:
        child.stop()
    shutil.rmtree(SERVER.get("tmp", "/nonexistent"), ignore_errors=True)


# ---- the reference: kernels/adamw.h in numpy FP32 --------------------------------------------


def bf16_bits(x):
    """float32 -> bfloat16 bits (uint16), round to nearest even (finite x)."""
    u = np.ascontiguousarray(x, dtype=F32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_to_f32(b):
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(F32)


def adamw_scalars(lr, betas, eps, wd, t, grad_scale, bias_correction=True):
    """MakeAdamWScalars: double arithmetic, each scalar rounded to FP32 once."""
    b1, b2 = betas
    bc1 = 1.0 - math.pow(b1, float(t)) if bias_correction else 1.0
    bc2 = 1.0 - math.pow(b2, float(t)) if bias_correction else 1.0
    return dict(decay=F32(1.0 - lr * wd), beta1=F32(b1), one_minus_beta1=F32(1.0 - b1),
                beta2=F32(b2), one_minus_beta2=F32(1.0 - b2), step_size=F32(lr / bc1),
                bc2_sqrt=F32(math.sqrt(bc2)), eps=F32(eps), grad_scale=F32(grad_scale))


def adamw_update(p, m, v, g, s):
    """AdamWUpdate on whole arrays: every operation a separate FP32 ufunc
    (round to nearest even, no fused multiply-add), in the documented order."""
    assert p.dtype == m.dtype == v.dtype == g.dtype == F32
    g = g * s["grad_scale"]
    p = p * s["decay"]
    m = (s["beta1"] * m) + (s["one_minus_beta1"] * g)
    v = (s["beta2"] * v) + ((s["one_minus_beta2"] * g) * g)
    denom = (np.sqrt(v) / s["bc2_sqrt"]) + s["eps"]
    p = p - ((s["step_size"] * m) / denom)
    for a in (g, p, m, v, denom):
        assert a.dtype == F32
    return p, m, v


FP8_FIELDS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


class OptimizerClientTest(unittest.TestCase):
    def setUp(self):
        self.c = qtx.Client(SERVER["target"], timeout=60)
        self.rng = np.random.default_rng(11)

    def tearDown(self):
        for g in self.c.list_optimizer_groups().groups:
            self.c.release_group(g.name)
        self.c.close()

    def assert_bits_equal(self, got, want, msg):
        """Same shape, dtype and bytes (float32 compared as bits: -0 != +0)."""
        self.assertEqual((got.shape, got.dtype), (want.shape, want.dtype), msg)
        ints = {1: np.uint8, 2: np.uint16, 4: np.uint32}[want.dtype.itemsize]
        ne = np.ascontiguousarray(got).view(ints) != np.ascontiguousarray(want).view(ints)
        diff = int(np.count_nonzero(ne))
        if diff:
            at = tuple(int(i[0]) for i in np.nonzero(ne))
            self.fail("%s: %d of %d elements differ (first at %s: %r vs %r)"
                      % (msg, diff, want.size, at, got[at], want[at]))

    def assert_fp8_is_quantize_of(self, q, master, msg):
        ref = self.c.quantize(master, mode="2d", columnwise=True)
        self.assertEqual(q.shape, master.shape, msg)
        self.assertEqual((q.mode, q.format), ("2d", "e4m3"), msg)
        for f in FP8_FIELDS:
            got = getattr(q, f)
            self.assertIsNotNone(got, "%s %s" % (msg, f))
            self.assert_bits_equal(got, getattr(ref, f), "%s %s" % (msg, f))

    def test_steps_match_numpy_adamw_and_quantize(self):
        init = {n: (self.rng.standard_normal(s) * 0.1).astype(F32) for n, s in SHAPES.items()}
        info = self.c.offload_optimizer_state("py-mlp", init, lr=LR, betas=BETAS, eps=EPS,
                                              weight_decay=WD)
        self.assertIsInstance(info, qtx.OptimizerGroupInfo)
        self.assertEqual((info.name, info.step, info.update_count, info.num_parameters),
                         ("py-mlp", 0, 0, 2))
        self.assertEqual(info.num_elements, 130 * 200 + 64 * 128)
        self.assertEqual(info.hyper_params, qtx.AdamWHyperParams(LR, BETAS, EPS, WD, True))
        self.assertEqual(info.output, qtx.ParameterOutputConfig())  # FP8 2-D, both copies
        self.assertEqual(info.moment_dtype, "float32")
        self.assertEqual(info.last_checkpoint_step, -1)

        p = {n: a.copy() for n, a in init.items()}
        m = {n: np.zeros(s, F32) for n, s in SHAPES.items()}
        v = {n: np.zeros(s, F32) for n, s in SHAPES.items()}
        # step 2 clips (the global norm is ~ sqrt(34192) ~ 185), step 3 overrides lr.
        plan = {1: {}, 2: {"max_grad_norm": 5.0}, 3: {"lr": 3e-3}}
        last = None
        for t, kwargs in plan.items():
            grads = {n: self.rng.standard_normal(s).astype(F32) for n, s in SHAPES.items()}
            r = self.c.step("py-mlp", t, grads, **kwargs)
            norm = math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2))
                                 for g in grads.values()))
            self.assertEqual(r.stats.step, t)
            self.assertFalse(r.stats.skipped or r.stats.replayed or r.stats.non_finite)
            self.assertAlmostEqual(r.stats.grad_norm / norm, 1.0, delta=1e-12)
            lr = kwargs.get("lr", LR)
            self.assertEqual(r.stats.lr, lr)
            if "max_grad_norm" in kwargs:
                want_coef = kwargs["max_grad_norm"] / (norm + 1e-6)
                self.assertLess(want_coef, 1.0)
                self.assertAlmostEqual(r.stats.clip_coef / want_coef, 1.0, delta=1e-12)
            else:
                self.assertEqual(r.stats.clip_coef, 1.0)
            # The server's coefficient (a double) feeds the FP32 grad_scale.
            s = adamw_scalars(lr, BETAS, EPS, WD, t, r.stats.clip_coef)
            for n in SHAPES:
                p[n], m[n], v[n] = adamw_update(p[n], m[n], v[n], grads[n], s)
            st = self.c.get_state("py-mlp", include_moments=True)
            self.assertEqual((st.group.step, st.group.update_count), (t, t))
            self.assertEqual(list(st.parameters), list(SHAPES))
            self.assertEqual(list(r.parameters), list(SHAPES))
            for n in SHAPES:
                ps = st.parameters[n]
                self.assertEqual(ps.master.dtype, F32)
                self.assert_bits_equal(ps.master, p[n], "%s master after step %d" % (n, t))
                self.assert_bits_equal(ps.exp_avg, m[n], "%s exp_avg after step %d" % (n, t))
                self.assert_bits_equal(ps.exp_avg_sq, v[n],
                                       "%s exp_avg_sq after step %d" % (n, t))
                out = r.parameters[n]
                self.assertIsNone(out.bf16)
                self.assert_fp8_is_quantize_of(out.fp8, ps.master, "%s step %d" % (n, t))
            last = r

        # A retried step number: replayed, not applied again (other gradients ignored).
        again = self.c.step("py-mlp", 3, {n: np.ones(s, F32) for n, s in SHAPES.items()})
        self.assertTrue(again.stats.replayed)
        self.assertEqual(again.stats.step, 3)
        self.assertEqual(again.stats.grad_norm, last.stats.grad_norm)
        for n in SHAPES:
            for f in FP8_FIELDS:
                self.assert_bits_equal(getattr(again.parameters[n].fp8, f),
                                       getattr(last.parameters[n].fp8, f), n + " retry " + f)
        masters = self.c.get_state("py-mlp", names=["w2"]).parameters
        self.assertEqual(list(masters), ["w2"])
        self.assert_bits_equal(masters["w2"].master, p["w2"], "w2 after the retry")

        # Stale and future step numbers.
        grads = {n: np.zeros(s, F32) for n, s in SHAPES.items()}
        for bad in (1, 2, 5):
            with self.assertRaises(qtx.errors.FailedPreconditionError) as cm:
                self.c.step("py-mlp", bad, grads)
            e = cm.exception
            self.assertEqual(e.code.name, "FAILED_PRECONDITION")
            self.assertIn("'py-mlp' is at step 3", e.message)
            self.assertIn("got step %d" % bad, e.message)
            self.assertIsInstance(e, qtx.QtxError)

        # A non-finite gradient with skip_if_non_finite: skipped, the step advances,
        # AdamW's t does not (step 5 applies t = 4).
        nan_grads = {n: self.rng.standard_normal(s).astype(F32) for n, s in SHAPES.items()}
        nan_grads["w2"][3, 7] = np.nan
        r = self.c.step("py-mlp", 4, nan_grads, skip_if_non_finite=True)
        self.assertTrue(r.stats.skipped and r.stats.non_finite)
        st = self.c.get_state("py-mlp")
        self.assertEqual((st.group.step, st.group.update_count), (4, 3))
        for n in SHAPES:
            self.assert_bits_equal(st.parameters[n].master, p[n], n + " after a skipped step")
            self.assert_fp8_is_quantize_of(r.parameters[n].fp8, p[n], n + " skipped step")
        grads = {n: self.rng.standard_normal(s).astype(F32) for n, s in SHAPES.items()}
        r = self.c.step("py-mlp", 5, grads, omit_parameters=True)
        self.assertEqual(r.parameters, {})
        s = adamw_scalars(LR, BETAS, EPS, WD, 4, 1.0)
        st = self.c.get_state("py-mlp")
        for n in SHAPES:
            p[n], m[n], v[n] = adamw_update(p[n], m[n], v[n], grads[n], s)
            self.assert_bits_equal(st.parameters[n].master, p[n], n + " after step 5 (t=4)")

        # release_group, then list_optimizer_groups.
        groups = self.c.list_optimizer_groups()
        self.assertEqual([(g.name, g.step) for g in groups.groups], [("py-mlp", 5)])
        self.assertGreater(groups.memory_used_bytes, 0)
        self.c.release_group("py-mlp")
        self.assertEqual(self.c.list_optimizer_groups().groups, [])
        with self.assertRaises(qtx.errors.NotFoundError):
            self.c.step("py-mlp", 6, grads)
        with self.assertRaises(qtx.errors.NotFoundError):
            self.c.release_group("py-mlp")

    def test_two_phase_steps_over_two_groups(self):
        init = {n: (self.rng.standard_normal(s) * 0.1).astype(F32) for n, s in SHAPES.items()}
        ranks = {"py-r0": ["w1"], "py-r1": ["w2"]}
        for g, names in ranks.items():
            self.c.offload_optimizer_state(g, {n: init[n] for n in names}, lr=LR, betas=BETAS,
                                           eps=EPS, weight_decay=WD)
        p = {n: a.copy() for n, a in init.items()}
        m = {n: np.zeros(s, F32) for n, s in SHAPES.items()}
        v = {n: np.zeros(s, F32) for n, s in SHAPES.items()}
        for t in (1, 2):
            grads = {n: self.rng.standard_normal(s).astype(F32) for n, s in SHAPES.items()}
            norms = {g: self.c.grad_norm(g, t, {n: grads[n] for n in names})
                     for g, names in ranks.items()}
            for res in norms.values():
                self.assertIsInstance(res, qtx.GradNormResult)
                self.assertEqual((res.step, res.non_finite, res.step_processed), (t, False, False))
                self.assertEqual(res.grad_norm, math.sqrt(res.sum_squares))
            total = sum(res.sum_squares for res in norms.values())
            want = sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads.values())
            self.assertAlmostEqual(total / want, 1.0, delta=1e-12)
            clip = qtx.clip_factor(total, 5.0)
            self.assertEqual(clip, min(1.0, 5.0 / (math.sqrt(total) + 1e-6)))
            self.assertLess(clip, 1.0)
            for g, names in ranks.items():
                r = self.c.step(g, t, {n: grads[n] for n in names}, clip_factor=clip)
                self.assertEqual((r.stats.clip_coef, r.stats.grad_norm), (clip, 0.0))
            s = adamw_scalars(LR, BETAS, EPS, WD, t, clip)
            for n in SHAPES:
                p[n], m[n], v[n] = adamw_update(p[n], m[n], v[n], grads[n], s)
            for g, names in ranks.items():
                st = self.c.get_state(g, include_moments=True)
                for n in names:
                    self.assert_bits_equal(st.parameters[n].master, p[n], "%s step %d" % (n, t))
                    self.assert_bits_equal(st.parameters[n].exp_avg_sq, v[n],
                                           "%s exp_avg_sq step %d" % (n, t))
        # skip: no gradients needed, nothing changes, a retry replays.
        for g, names in ranks.items():
            r = self.c.step(g, 3, {}, skip=True)
            self.assertTrue(r.stats.skipped)
            for n in names:
                self.assert_fp8_is_quantize_of(r.parameters[n].fp8, p[n], n + " skipped")
            self.assertTrue(self.c.step(g, 3, {}, skip=True).stats.replayed)
            st = self.c.get_state(g)
            self.assertEqual((st.group.step, st.group.update_count), (3, 2))
            for n in names:
                self.assert_bits_equal(st.parameters[n].master, p[n], n + " after the skip")
        # Errors a person can act on.
        grads = {"w1": np.zeros(SHAPES["w1"], F32)}
        with self.assertRaises(qtx.errors.InvalidArgumentError) as cm:
            self.c.step("py-r0", 4, grads, clip_factor=0.0)
        self.assertIn("clip_factor=0: must be finite and > 0", cm.exception.message)
        with self.assertRaises(qtx.errors.InvalidArgumentError) as cm:
            self.c.step("py-r0", 4, grads, clip_factor=0.5, skip_if_non_finite=True)
        self.assertIn("clip_factor with skip_if_non_finite", cm.exception.message)
        with self.assertRaises(qtx.errors.FailedPreconditionError) as cm:
            self.c.grad_norm("py-r0", 7, grads)
        self.assertIn("'py-r0' is at step 3: GradNorm measures the gradients of its next step 4",
                      cm.exception.message)
        # Reduced by the sidecars of a Collective group (here of one rank: the
        # multi-rank case is tests/client/collective_e2e_test.cc).
        self.c.create_group("py-solo", 0, 1, backend="gloo")
        try:
            g = {"w1": self.rng.standard_normal(SHAPES["w1"]).astype(F32)}
            local = self.c.grad_norm("py-r0", 4, g)
            res = self.c.grad_norm("py-r0", 4, g, collective_group="py-solo", sequence=0)
            self.assertEqual((res.ranks, res.total_sum_squares, res.total_non_finite),
                             (1, local.sum_squares, False))
            with self.assertRaises(qtx.errors.FailedPreconditionError) as cm:
                self.c.grad_norm("py-r0", 4, g, collective_group="py-solo", sequence=0)
            self.assertIn("sequence 0 was already used", cm.exception.message)
        finally:
            self.c.destroy_group("py-solo")

    def test_per_parameter_weight_decay_and_lr_scale(self):
        init = {n: (self.rng.standard_normal(s) * 0.1).astype(F32) for n, s in SHAPES.items()}
        with self.assertRaises(ValueError) as cm:
            self.c.offload_optimizer_state("py-pp", init, lr_scales=[1.0])
        self.assertIn("lr_scales: 1 values for 2 parameters", str(cm.exception))
        with self.assertRaises(ValueError) as cm:
            self.c.offload_optimizer_state("py-pp", init, weight_decays={"w3": 0.0})
        self.assertIn("['w3']: not a parameter of the group", str(cm.exception))
        with self.assertRaises(qtx.errors.InvalidArgumentError) as cm:
            self.c.offload_optimizer_state("py-pp", init, weight_decays={"w2": -0.5})
        self.assertIn("parameters[1] ('w2').weight_decay=-0.5: must be finite and >= 0",
                      cm.exception.message)
        info = self.c.offload_optimizer_state("py-pp", init, lr=LR, betas=BETAS, eps=EPS,
                                              weight_decay=WD, weight_decays={"w2": 0.0},
                                              lr_scales=[None, 0.5])
        self.assertEqual(info.parameter_hyper_params, {"w2": (0.0, 0.5)})
        own = {"w1": (LR, WD), "w2": (LR * 0.5, 0.0)}
        p = {n: a.copy() for n, a in init.items()}
        m = {n: np.zeros(s, F32) for n, s in SHAPES.items()}
        v = {n: np.zeros(s, F32) for n, s in SHAPES.items()}
        for t in (1, 2):
            grads = {n: self.rng.standard_normal(s).astype(F32) for n, s in SHAPES.items()}
            self.c.step("py-pp", t, grads, omit_parameters=True)
            st = self.c.get_state("py-pp", include_moments=True)
            for n in SHAPES:
                lr, wd = own[n]
                s = adamw_scalars(lr, BETAS, EPS, wd, t, 1.0)
                p[n], m[n], v[n] = adamw_update(p[n], m[n], v[n], grads[n], s)
                self.assert_bits_equal(st.parameters[n].master, p[n], "%s step %d" % (n, t))
                self.assert_bits_equal(st.parameters[n].exp_avg, m[n], "%s m step %d" % (n, t))

    def test_bf16_output_moments_and_checkpoints(self):
        shape = (64, 128)
        master_bits = bf16_bits(self.rng.standard_normal(shape) * 0.1)  # BF16 master, widened
        m0 = (self.rng.standard_normal(shape) * 1e-2).astype(F32)
        v0 = (self.rng.standard_normal(shape) ** 2 * 1e-4).astype(F32)
        init = [qtx.ParameterInit("w", master_bits, exp_avg=bf16_bits(m0),
                                  exp_avg_sq=bf16_bits(v0))]
        info = self.c.offload_optimizer_state(
            "py-bf16", init, lr=2e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0,
            bias_correction=False, moment_dtype="bfloat16", output="bf16", step=7)
        self.assertEqual((info.step, info.update_count, info.moment_dtype), (7, 7, "bfloat16"))
        self.assertEqual(info.output.output, "bf16")
        self.assertEqual(info.hyper_params,
                         qtx.AdamWHyperParams(2e-3, (0.8, 0.99), 1e-6, 0.0, False))
        st = self.c.get_state("py-bf16", include_moments=True).parameters["w"]
        self.assert_bits_equal(st.master, bf16_to_f32(master_bits), "widened master")
        self.assertEqual(st.exp_avg.dtype, np.uint16)
        self.assert_bits_equal(st.exp_avg, bf16_bits(m0), "exp_avg as given")

        with self.assertRaises(qtx.errors.FailedPreconditionError) as cm:
            self.c.step("py-bf16", 1, {"w": np.zeros(shape, F32)})
        self.assertIn("is at step 7", cm.exception.message)

        p, m, v = bf16_to_f32(master_bits), bf16_to_f32(bf16_bits(m0)), bf16_to_f32(bf16_bits(v0))
        saved = None
        for t in (8, 9):
            g = self.rng.standard_normal(shape).astype(F32)
            # BF16 gradient bits for step 9: widened exactly by the server.
            sent = g if t == 8 else bf16_bits(g)
            r = self.c.step("py-bf16", t, {"w": sent})
            s = adamw_scalars(2e-3, (0.8, 0.99), 1e-6, 0.0, t, 1.0, bias_correction=False)
            p, m, v = adamw_update(p, m, v, g if t == 8 else bf16_to_f32(sent), s)
            m, v = bf16_to_f32(bf16_bits(m)), bf16_to_f32(bf16_bits(v))  # stored as BF16
            out = r.parameters["w"]
            self.assertIsNone(out.fp8)
            self.assertEqual(out.bf16.dtype, np.uint16)
            self.assert_bits_equal(out.bf16, bf16_bits(p), "bf16 parameter step %d" % t)
            st = self.c.get_state("py-bf16", include_moments=True).parameters["w"]
            self.assert_bits_equal(st.master, p, "bf16-moment master step %d" % t)
            self.assert_bits_equal(st.exp_avg, bf16_bits(m), "bf16 exp_avg step %d" % t)
            self.assert_bits_equal(st.exp_avg_sq, bf16_bits(v), "bf16 exp_avg_sq step %d" % t)
            if t == 8:
                ck = self.c.save_checkpoint("py-bf16")
                self.assertEqual(len(ck), 1)
                self.assertIsInstance(ck[0], qtx.CheckpointInfo)
                self.assertEqual((ck[0].group, ck[0].step), ("py-bf16", 8))
                self.assertTrue(os.path.exists(ck[0].path), ck[0].path)
                self.assertGreater(ck[0].bytes, 0)
                saved = p.copy()
        info = self.c.load_checkpoint("py-bf16")
        self.assertEqual((info.step, info.last_checkpoint_step), (8, 8))
        st = self.c.get_state("py-bf16").parameters["w"]
        self.assert_bits_equal(st.master, saved, "master after load_checkpoint")
        self.c.release_group("py-bf16")
        self.assertEqual([g.name for g in self.c.list_optimizer_groups().groups], [])

    def test_fp8_1d_with_bf16_copy(self):
        w = (self.rng.standard_normal((3, 40, 96)) * 0.05).astype(F32)
        info = self.c.offload_optimizer_state("py-1d", {"w": w}, mode="1d", columnwise=False,
                                              bf16_copy=True)
        self.assertEqual((info.output.mode, info.output.columnwise, info.output.bf16_copy),
                         ("1d", False, True))
        r = self.c.step("py-1d", 1, {"w": self.rng.standard_normal(w.shape).astype(F32)})
        master = self.c.get_state("py-1d").parameters["w"].master
        self.assertEqual(master.shape, w.shape)
        out = r.parameters["w"]
        ref = self.c.quantize(master, mode="1d")
        self.assertEqual(out.fp8.mode, "1d")
        self.assertIsNone(out.fp8.columnwise_data)
        self.assert_bits_equal(out.fp8.rowwise_data, ref.rowwise_data, "1d rowwise_data")
        self.assert_bits_equal(out.fp8.rowwise_scale_inv, ref.rowwise_scale_inv,
                               "1d rowwise_scale_inv")
        self.assert_bits_equal(out.bf16, bf16_bits(master).reshape(w.shape), "bf16 copy")

    def test_fp8_tensor_output_is_labelled_and_dequantizes(self):
        # Per-tensor current scaling: the step's FP8 output and the group's
        # output config say 'tensor' (not a block mode), and the output
        # dequantizes and equals quantize() of the updated master.
        w = (self.rng.standard_normal((70, 200)) * 0.05).astype(F32)
        info = self.c.offload_optimizer_state("py-tensor", {"w": w}, mode="tensor")
        self.assertEqual(info.output.mode, "tensor")
        self.assertEqual(self.c.list_optimizer_groups().groups[0].output.mode, "tensor")
        r = self.c.step("py-tensor", 1, {"w": self.rng.standard_normal(w.shape).astype(F32)})
        master = self.c.get_state("py-tensor").parameters["w"].master
        out = r.parameters["w"].fp8
        ref = self.c.quantize(master, mode="tensor", columnwise=True)
        self.assertEqual(out.mode, "tensor")
        for f in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
            self.assert_bits_equal(getattr(out, f), getattr(ref, f), "tensor " + f)
        self.assert_bits_equal(self.c.dequantize(out), self.c.dequantize(ref), "dequantized")
        self.c.release_group("py-tensor")

    def test_argument_errors(self):
        w = np.zeros((4, 8), F32)
        self.c.offload_optimizer_state("py-err", {"w": w})
        with self.assertRaises(qtx.errors.AlreadyExistsError):
            self.c.offload_optimizer_state("py-err", {"w": w})
        info = self.c.offload_optimizer_state("py-err", {"w": w, "b": np.zeros(8, F32)},
                                              replace=True)
        self.assertEqual(info.num_parameters, 2)
        with self.assertRaises(qtx.errors.InvalidArgumentError) as cm:
            self.c.step("py-err", 1, {"w": np.zeros((4, 9), F32), "b": np.zeros(8, F32)})
        self.assertIn("w", cm.exception.message)
        with self.assertRaises(qtx.errors.InvalidArgumentError):
            self.c.offload_optimizer_state("py-err2", {"w": w}, lr=-1.0)
        with self.assertRaises(qtx.errors.InvalidArgumentError):
            self.c.step("py-err", 1, {"w": w, "b": np.zeros(8, F32)}, max_grad_norm=0.0)
        with self.assertRaises(ValueError):
            self.c.offload_optimizer_state("py-err2", {"w": w}, output="fp16")
        with self.assertRaises(ValueError):
            self.c.offload_optimizer_state("py-err2", {"w": w}, moment_dtype="fp8")
        with self.assertRaises(TypeError):
            self.c.offload_optimizer_state("py-err2", {"w": w.astype(np.float64)})
        with self.assertRaises(qtx.errors.NotFoundError):
            self.c.get_state("nope")
        with self.assertRaises(qtx.errors.NotFoundError):
            self.c.load_checkpoint("py-never-saved")


def main():
    global ARGS, qtx
    parser = argparse.ArgumentParser()
    parser.add_argument("--qtxd", required=True)
    parser.add_argument("--python_dir", required=True)
    ARGS, rest = parser.parse_known_args()
    sys.path.insert(0, ARGS.python_dir)
    import qtx as qtx_pkg
    qtx = qtx_pkg
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)


if __name__ == "__main__":
    main()
