"""qtx.Client: a thin, synchronous Python wrapper over the generated stubs.

    import numpy as np, qtx
    with qtx.Client("unix:///tmp/qtxd.sock") as c:
        q = c.quantize(np.random.randn(256, 1024).astype(np.float32), mode="2d",
                       columnwise=True)
        x = c.dequantize(q)

Inputs are numpy arrays (float32, float16) or torch tensors (float32,
bfloat16, float16) when torch is importable; outputs are numpy arrays, or
torch tensors when the input was one. Layouts are the C++ client's (README:
rowwise [M, N] u8, columnwise [N, M] u8, FP32 scale_inv with padded rows).
The Optimizer calls (offload_optimizer_state, step, get_state, checkpoints,
release_group, list_optimizer_groups) use the types of ``qtx.optimizer``;
optimizer_state_dict / load_optimizer_state_dict move a group's state in and
out in torch.optim.AdamW's state_dict form.
Every failure raises a ``qtx.errors.QtxError`` subclass named after its gRPC
code. A Client is safe for concurrent use by several threads.
"""

import dataclasses
import itertools
import math
import secrets
import time

import grpc
import numpy as np

from qtx import errors
from qtx import optimizer as opt
from qtx.v1 import collective_pb2, collective_pb2_grpc, optimizer_pb2, optimizer_pb2_grpc
from qtx.v1 import memory_pb2, memory_pb2_grpc, quantizer_pb2, quantizer_pb2_grpc, tensor_pb2

try:  # torch is optional
    import torch  # noqa: F401
except Exception:  # pragma: no cover - depends on the machine
    torch = None

DEFAULT_TARGET = "unix:///tmp/qtxd.sock"
MAX_MESSAGE_BYTES = 2**31 - 1

# "tensor": per-tensor current scaling (one amax, one scale_inv of shape [1]).
_MODES = {"1d": quantizer_pb2.BLOCK_1D, "2d": quantizer_pb2.BLOCK_2D,
          "tensor": quantizer_pb2.TENSOR}
_FORMATS = {"e4m3": quantizer_pb2.E4M3, "e5m2": quantizer_pb2.E5M2}
_NP_DTYPES = {np.dtype(np.float32): tensor_pb2.FLOAT32, np.dtype(np.float16): tensor_pb2.FLOAT16}
_OUT_DTYPES = {"float32": tensor_pb2.FLOAT32, "bfloat16": tensor_pb2.BFLOAT16,
               "float16": tensor_pb2.FLOAT16}
_GATHER_MODES = {"exact_fp8": collective_pb2.EXACT_FP8,
                 "gather_high_precision": collective_pb2.GATHER_HIGH_PRECISION}
_BACKENDS = {"auto": collective_pb2.COMM_BACKEND_UNSPECIFIED, "gloo": collective_pb2.GLOO,
             "nccl": collective_pb2.NCCL}


def _is_torch(x):
    return torch is not None and isinstance(x, torch.Tensor)


@dataclasses.dataclass
class QuantizedTensor:
    """A block-scaled FP8 tensor as qtxd returns it (inline copies)."""
    shape: tuple
    mode: str
    format: str
    rowwise_data: object = None          # [M, N] uint8
    rowwise_scale_inv: object = None     # float32, 2-D
    columnwise_data: object = None       # [N, M] uint8
    columnwise_scale_inv: object = None  # float32, 2-D
    proto: object = None                 # the qtx.v1.QuantizedTensor


@dataclasses.dataclass
class AllGatherResult:
    """What Client.all_gather returns on every rank."""
    tensor: QuantizedTensor  # the quantized [sum M_r, N] tensor
    shard_rows: list         # M_r of every rank, in rank order


@dataclasses.dataclass
class ParameterAllGatherResult:
    """What Client.all_gather_parameter returns on every rank."""
    tensor: QuantizedTensor  # the whole parameter's rowwise copy ([M, N] u8 + scale_inv)
    ranges: list             # every rank's (begin, end), in rank order


def normalize_target(target):
    """'unix:///abs', 'unix:path', '/abs/path' (unix) or 'host:port'."""
    if not target:
        raise ValueError("target is empty")
    if target.startswith("/"):
        return "unix://" + target
    return target


def channel(target=DEFAULT_TARGET, max_message_bytes=MAX_MESSAGE_BYTES, root_certificates=None,
            private_key=None, certificate_chain=None):
    """A grpc.Channel to qtxd with raised message limits; TLS when any PEM
    argument (bytes) is given, plaintext otherwise."""
    target = normalize_target(target)
    options = [("grpc.max_send_message_length", max_message_bytes),
               ("grpc.max_receive_message_length", max_message_bytes)]
    if root_certificates or private_key or certificate_chain:
        creds = grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)
        return grpc.secure_channel(target, creds, options=options)
    return grpc.insecure_channel(target, options=options)


class Client:
    """A client of one qtxd. See the module doc."""

    def __init__(self, target=DEFAULT_TARGET, token=None, token_file=None, timeout=60.0,
                 root_certificates=None, private_key=None, certificate_chain=None,
                 max_message_bytes=MAX_MESSAGE_BYTES):
        if token_file:
            with open(token_file, "r", encoding="ascii") as f:
                token = f.read().strip()
        self.target = normalize_target(target)
        self.timeout = timeout
        self._token = token
        self._channel = channel(self.target, max_message_bytes, root_certificates, private_key,
                                certificate_chain)
        self.quantizer = quantizer_pb2_grpc.QuantizerStub(self._channel)
        self.memory = memory_pb2_grpc.MemoryStub(self._channel)
        self.collective = collective_pb2_grpc.CollectiveStub(self._channel)
        self.optimizer = optimizer_pb2_grpc.OptimizerStub(self._channel)
        self._health = self._channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=_encode_health_request,
            response_deserializer=_decode_health_response)
        self._id_prefix = secrets.token_hex(4)
        self._counter = itertools.count(1)

    # ---- plumbing -----------------------------------------------------------------------------

    def metadata(self, request_id=None):
        """Call metadata: the request id and, with a token, the authorization."""
        md = [("x-request-id", request_id or "%s-%d" % (self._id_prefix, next(self._counter)))]
        if self._token:
            md.append(("authorization", "Bearer " + self._token))
        return md

    def _call(self, method, request, timeout=None, request_id=None, wait_for_ready=None):
        try:
            return method(request, timeout=timeout or self.timeout,
                          metadata=self.metadata(request_id), wait_for_ready=wait_for_ready)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from None

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- health -------------------------------------------------------------------------------

    def health(self, service="", timeout=None):
        """'SERVING', 'NOT_SERVING', 'SERVICE_UNKNOWN' or 'UNKNOWN'."""
        try:
            return self._call(self._health, service, timeout)
        except errors.NotFoundError:
            return "SERVICE_UNKNOWN"

    def wait_until_serving(self, timeout):
        """Returns once qtxd reports SERVING, waiting for it to come up: a
        trainer that starts before its sidecar, or a sidecar that restarts.
        Each health check waits for the connection (gRPC wait_for_ready);
        between checks it backs off from 10 ms to 200 ms. Raises
        errors.DeadlineExceededError naming the last status or error seen
        after `timeout` seconds (C++: qtx::Client::WaitUntilServing)."""
        deadline = time.monotonic() + timeout
        backoff = 0.01
        last = "no health check made"
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                status = self._call(self._health, "", min(left, 2.0), wait_for_ready=True)
                if status == "SERVING":
                    return
                last = "status " + status
            except errors.QtxError as e:
                last = str(e)
            time.sleep(max(0.0, min(backoff, deadline - time.monotonic())))
            backoff = min(backoff * 2, 0.2)
        raise errors.DeadlineExceededError("'%s' not SERVING after %g s; last health check: %s"
                                           % (self.target, timeout, last))

    # ---- quantizer ----------------------------------------------------------------------------

    def quantize(self, x, mode="1d", format="e4m3", rowwise=True, columnwise=False,
                 pow2_scales=True, amax_epsilon=0.0, timeout=None, request_id=None):
        """Quantizes `x` ([..., N]; leading dims are flattened into M). mode: '1d'
        (1x128 blocks), '2d' (128x128) or 'tensor' (per-tensor current scaling:
        one scale_inv of shape [1] per copy)."""
        as_torch = _is_torch(x)
        ref = tensor_to_proto(x)
        cfg = _quantize_config(mode, format, rowwise, columnwise, pow2_scales, amax_epsilon)
        resp = self._call(self.quantizer.Quantize,
                          quantizer_pb2.QuantizeRequest(input=ref, config=cfg), timeout,
                          request_id)
        return _quantized_from_proto(resp.result, mode, format, as_torch)

    def dequantize(self, q, dtype="float32", timeout=None, request_id=None):
        """Dequantizes a QuantizedTensor (its rowwise copy when present)."""
        if dtype not in _OUT_DTYPES:
            raise ValueError("dtype=%r: must be one of %s" % (dtype, sorted(_OUT_DTYPES)))
        as_torch = _is_torch(q.rowwise_data if q.rowwise_data is not None else q.columnwise_data)
        req = quantizer_pb2.DequantizeRequest(input=q.proto, output_dtype=_OUT_DTYPES[dtype])
        resp = self._call(self.quantizer.Dequantize, req, timeout, request_id)
        return tensor_from_proto(resp.output, as_torch)

    # ---- memory -------------------------------------------------------------------------------

    def register_shm_region(self, region, timeout=None):
        """Registers a qtx.ShmRegion under region.name (qtxd --allow_client_shm)."""
        req = memory_pb2.RegisterRegionRequest(
            name=region.name,
            shm=memory_pb2.ShmRegion(shm_name=region.shm_name, offset=0,
                                     byte_size=region.byte_size))
        self._call(self.memory.RegisterRegion, req, timeout)

    def unregister_region(self, name, timeout=None):
        self._call(self.memory.UnregisterRegion, memory_pb2.UnregisterRegionRequest(name=name),
                   timeout)

    def list_regions(self, timeout=None):
        """The server's regions: a list of qtx.v1.RegionInfo."""
        return list(self._call(self.memory.ListRegions, memory_pb2.ListRegionsRequest(),
                               timeout).regions)

    def quantize_region(self, region, offset, shape, dtype="float32", **kwargs):
        """Quantizes the tensor stored in `region` at `offset` (no inline input copy)."""
        dt = {"float32": tensor_pb2.FLOAT32, "float16": tensor_pb2.FLOAT16,
              "bfloat16": tensor_pb2.BFLOAT16}[dtype]
        nbytes = int(np.prod(shape)) * (4 if dtype == "float32" else 2)
        ref = tensor_pb2.TensorRef(dtype=dt, shape=list(shape),
                                   region=tensor_pb2.RegionSlice(region=region.name,
                                                                 offset=offset, size=nbytes))
        return self.quantize(ref, **kwargs)

    # ---- collective ---------------------------------------------------------------------------
    # One qtxd per rank; each rank calls its own. create_group and all_gather
    # return once every rank has made the matching call.

    def create_group(self, name, rank, world_size, coordinator="", backend="auto",
                     group_timeout=60.0, timeout=None):
        """Joins the group `name` as `rank` of `world_size`; `coordinator` is
        rank 0's sidecar as this rank's sidecar reaches it ('unix:/path' or
        'host:port'; rank 0 may leave it empty). backend: 'auto' (NCCL on a
        GPU sidecar, else Gloo), 'gloo' or 'nccl'. Waits up to group_timeout
        seconds for every rank (also the group's collective deadline).
        Returns the qtx.v1.GroupInfo."""
        if backend not in _BACKENDS:
            raise ValueError("backend=%r: must be one of %s" % (backend, sorted(_BACKENDS)))
        if not 0 <= group_timeout < 2**32 / 1000:
            raise ValueError("group_timeout=%r: must be >= 0 seconds (0 = the server default)"
                             % group_timeout)
        req = collective_pb2.CreateGroupRequest(
            name=name, rank=rank, world_size=world_size, coordinator=coordinator,
            backend=_BACKENDS[backend], timeout_ms=math.ceil(group_timeout * 1000))
        if timeout is None:
            timeout = max(self.timeout, (group_timeout or 60.0) + 10.0)
        return self._call(self.collective.CreateGroup, req, timeout).group

    def all_gather(self, group, sequence, x, gather_mode="exact_fp8", mode="1d", format="e4m3",
                   rowwise=True, columnwise=False, pow2_scales=True, amax_epsilon=0.0,
                   timeout=None, request_id=None, shard_rows=None):
        """All-gathers this rank's shard `x` ([M_r, N]; any M_r, even 0) and
        returns AllGatherResult: the quantized [sum M_r, N] tensor (bit-identical
        to quantize() of the concatenated shards) and every rank's M_r.
        `sequence` counts the group's calls from 0, the same on every rank.
        gather_mode: 'exact_fp8' or 'gather_high_precision' (same bytes).
        shard_rows: optional list of every rank's M_r (the same on every rank);
        given, the sidecars need one all-gather and no exchange of shapes first.
        Pass it on every rank of a call or on none."""
        if gather_mode not in _GATHER_MODES:
            raise ValueError("gather_mode=%r: must be one of %s"
                             % (gather_mode, sorted(_GATHER_MODES)))
        as_torch = _is_torch(x)
        req = collective_pb2.AllGatherRequest(
            group=group, sequence=sequence, input=tensor_to_proto(x),
            config=_quantize_config(mode, format, rowwise, columnwise, pow2_scales,
                                    amax_epsilon),
            mode=_GATHER_MODES[gather_mode],
            shard_rows=[int(m) for m in (shard_rows or [])])
        resp = self._call(self.collective.AllGather, req, timeout, request_id)
        return AllGatherResult(_quantized_from_proto(resp.result, mode, format, as_torch),
                               list(resp.shard_rows))

    def all_gather_parameter(self, group, sequence, shard, shard_range, scale_inv=None,
                             shape=None, format="e4m3", pow2_scales=True, amax_epsilon=0.0,
                             name="", timeout=None, request_id=None):
        """The FP8 parameter all-gather: every rank passes its FP8 shard of a
        parameter quantized with 128x128 blocks, the bytes of elements
        shard_range = (begin, end) of the flattened [M, N] rowwise data, and
        gets the whole rowwise copy back (ParameterAllGatherResult), byte for
        byte the quantization of the whole parameter, with every rank's range.

        shard: a sharded step()'s ParameterOutput.fp8 as is (a QuantizedTensor:
        shape, format and the whole scale_inv come with it), or the FP8 bytes
        (uint8 numpy array or torch uint8 / float8 tensor, end - begin
        elements) with scale_inv (float32 [ceil(M/128), pad4(ceil(N/128))], the
        whole parameter's), shape (the whole parameter's), format, pow2_scales
        and amax_epsilon as it was quantized with. `sequence` is the group's
        call counter (shared with all_gather and sharded steps). Only the
        rowwise copy is gathered (the columnwise one is its byte transpose
        with the transposed scales, docs/numerics.md §4.5). Disagreements between
        the ranks (shape, config, scales, ranges that do not cover the
        parameter exactly once) raise InvalidArgumentError on every rank."""
        begin, end = (int(v) for v in shard_range)
        if isinstance(shard, QuantizedTensor):
            if shard.proto is not None:
                q = quantizer_pb2.QuantizedTensor()
                q.CopyFrom(shard.proto)
                q.ClearField("columnwise_data")
                q.ClearField("columnwise_scale_inv")
            else:
                q = quantizer_pb2.QuantizedTensor(
                    shape=list(shard.shape),
                    config=_quantize_config(shard.mode, shard.format, True, False, pow2_scales,
                                            amax_epsilon),
                    rowwise_data=_bytes_to_proto(shard.rowwise_data, shard.format),
                    rowwise_scale_inv=_scale_to_proto(shard.rowwise_scale_inv))
        else:
            if scale_inv is None or shape is None:
                raise ValueError("shard given as bytes: pass scale_inv= and shape= too")
            q = quantizer_pb2.QuantizedTensor(
                shape=[int(d) for d in shape],
                config=_quantize_config("2d", format, True, False, pow2_scales, amax_epsilon),
                rowwise_data=_bytes_to_proto(shard, format),
                rowwise_scale_inv=_scale_to_proto(scale_inv))
        req = collective_pb2.AllGatherParameterRequest(
            group=group, sequence=sequence, shard=q,
            range=optimizer_pb2.ShardRange(begin=begin, end=end), name=name)
        resp = self._call(self.collective.AllGatherParameter, req, timeout, request_id)
        mode, fmt = opt.quantized_names(resp.result.config)
        return ParameterAllGatherResult(
            _quantized_from_proto(resp.result, mode, fmt, False),
            [(g.begin, g.end) for g in resp.ranges])

    def destroy_group(self, name, timeout=None):
        self._call(self.collective.DestroyGroup, collective_pb2.DestroyGroupRequest(name=name),
                   timeout)

    def list_groups(self, timeout=None):
        """This sidecar's collective groups: a list of qtx.v1.GroupInfo."""
        return list(self._call(self.collective.ListGroups, collective_pb2.ListGroupsRequest(),
                               timeout).groups)


    # ---- optimizer ----------------------------------------------------------------------------
    # AdamW offload (qtx.v1.Optimizer; semantics in proto/qtx/v1/optimizer.proto). Types in
    # qtx.optimizer. Named as the C++ client's calls; list_optimizer_groups because
    # list_groups lists the Collective groups.

    def offload_optimizer_state(self, group, parameters, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                weight_decay=1e-2, bias_correction=True,
                                moment_dtype="float32", output="fp8", mode="2d",
                                format="e4m3", rowwise=True, columnwise=True,
                                pow2_scales=True, amax_epsilon=0.0, bf16_copy=False, step=0,
                                replace=False, timeout=None, request_id=None,
                                weight_decays=None, lr_scales=None, shards=None):
        """Hands a parameter group's master weights (and optionally its AdamW
        moments) to qtxd and returns its OptimizerGroupInfo.

        parameters: {name: master}, or a list of qtx.ParameterInit (with
        exp_avg/exp_avg_sq); masters are numpy float32, bfloat16 bits as numpy
        uint16, or torch float32/bfloat16. lr, betas, eps, weight_decay,
        bias_correction: torch.optim.AdamW's. moment_dtype: 'float32' or
        'bfloat16' (storage). output: 'fp8' (mode '2d' 128x128 tiles or '1d',
        both copies by default; bf16_copy=True adds a BF16 copy) or 'bf16'.
        step: steps already applied to the given state (the first step() then
        carries step + 1). replace: replace a group of that name (else
        AlreadyExistsError). weight_decays / lr_scales: per-parameter
        settings (e.g. weight decay 0 for norms and biases; a parameter's lr
        is the step's times its lr_scale), a {name: value} dict or one value
        (or None: the group's) per parameter in order; also
        ParameterInit.weight_decay / lr_scale. shards: data-parallel
        sharded state, {name: (begin, end)} (or one pair or None per
        parameter; also ParameterInit.shard): this sidecar owns elements
        [begin, end) of the flattened whole parameter, ParameterInit.shape
        gives the whole shape and master / moments hold the end - begin owned
        elements; every owner offloads the same parameters with its own
        ranges and steps with collective_group / sequence (client/README.md).
        ValueError for a range outside the shape or a master of another size."""
        req = optimizer_pb2.OffloadOptimizerStateRequest(
            group=group, moment_dtype=opt.choice(moment_dtype, opt.MOMENT_DTYPES,
                                                  "moment_dtype"),
            step=step, replace=replace)
        opt.hyper_to_proto(opt.AdamWHyperParams(lr, tuple(betas), eps, weight_decay,
                                                bias_correction), req.hyper_params)
        opt.output_to_proto(opt.ParameterOutputConfig(output, mode, format, rowwise, columnwise,
                                                      pow2_scales, amax_epsilon, bf16_copy),
                            req.output, _quantize_config)
        params = opt.parameters_from_arg(parameters)
        names = [p.name for p in params]
        wds = opt.per_parameter(weight_decays, names, "weight_decays")
        scales = opt.per_parameter(lr_scales, names, "lr_scales")
        ranges = opt.per_parameter(shards, names, "shards")
        for p in params:
            shard = ranges.get(p.name, p.shard)
            if shard is not None:
                shard = opt.check_shard(p, shard)
            master = opt.state_tensor_to_proto(p.master, "%s.master" % p.name, tensor_to_proto,
                                               _is_torch)
            init = req.parameters.add(name=p.name, master=master)
            wd = wds.get(p.name, p.weight_decay)
            if wd is not None:
                init.weight_decay = wd
            scale = scales.get(p.name, p.lr_scale)
            if scale is not None:
                init.lr_scale = scale
            init.shape.extend(p.shape if p.shape is not None else master.shape)
            if shard is not None:
                init.shard.begin, init.shard.end = shard
            if p.exp_avg is not None:
                init.exp_avg.CopyFrom(opt.state_tensor_to_proto(
                    p.exp_avg, "%s.exp_avg" % p.name, tensor_to_proto, _is_torch))
            if p.exp_avg_sq is not None:
                init.exp_avg_sq.CopyFrom(opt.state_tensor_to_proto(
                    p.exp_avg_sq, "%s.exp_avg_sq" % p.name, tensor_to_proto, _is_torch))
        resp = self._call(self.optimizer.OffloadOptimizerState, req, timeout, request_id)
        return opt.group_from_proto(resp.group)

    def step(self, group, step, gradients, lr=None, max_grad_norm=None, skip_if_non_finite=False,
             omit_parameters=False, timeout=None, request_id=None, clip_factor=None, skip=False,
             collective_group="", sequence=0):
        """Applies AdamW step number `step` (the group's step + 1; the group's
        step again replays the last result without applying it twice, any
        other number raises FailedPreconditionError) and returns a StepResult:
        .stats (grad_norm, clip_coef, skipped, replayed, ...) and .parameters
        {name: ParameterOutput(.fp8 QuantizedTensor, .bf16 uint16 bits)},
        inline. gradients: {name: array} (or (name, array) pairs), one per
        parameter: numpy float32/float16, bfloat16 bits as uint16, or torch
        (outputs are then torch tensors). lr: this step's learning rate (else
        the group's). max_grad_norm: global clipping as clip_grad_norm_.
        skip_if_non_finite: a NaN/Inf gradient skips the update (the step
        number still advances). clip_factor / skip: the second phase of a
        two-phase step (see grad_norm), decided by the caller over every
        group of every rank, not combined with max_grad_norm /
        skip_if_non_finite: clip_factor multiplies every gradient (finite,
        > 0; qtx.clip_factor computes clip_grad_norm_'s), skip=True skips the
        update without reading the gradients (they may be empty).
        collective_group / sequence: required for a data-parallel sharded
        group (offloaded with shards=) with FP8 output: the step is one call
        of that Collective group over the owners' sidecars (every owner
        calls with the same step and sequence, the group's call counter
        shared with all_gather / grad_norm), gradients are the owned slices,
        and each parameter's .fp8 is this owner's part: rowwise_data 1-D
        (the FP8 bytes of elements [begin, end) of the whole rowwise data),
        whole rowwise/columnwise_scale_inv, no columnwise_data; .bf16 is the
        owned slice, 1-D."""
        items = list(gradients.items() if hasattr(gradients, "items") else gradients)
        as_torch = bool(items) and all(_is_torch(g) for _, g in items)
        req = optimizer_pb2.StepRequest(group=group, step=step,
                                        skip_if_non_finite=skip_if_non_finite,
                                        omit_parameters=omit_parameters,
                                        collective_group=collective_group, sequence=sequence)
        for name, g in items:
            req.gradients.add(name=name, grad=opt.state_tensor_to_proto(
                g, "gradient %s" % name, tensor_to_proto, _is_torch))
        if lr is not None:
            req.lr = lr
        if max_grad_norm is not None:
            req.max_grad_norm = max_grad_norm
        if clip_factor is not None:
            req.clip_factor = clip_factor
        req.skip = skip
        resp = self._call(self.optimizer.Step, req, timeout, request_id)
        s = resp.stats
        stats = opt.StepStats(step=s.step, grad_norm=s.grad_norm, skipped=s.skipped,
                              non_finite=s.non_finite, clip_coef=s.clip_coef, lr=s.lr,
                              replayed=s.replayed)
        params = {}
        for p in resp.parameters:
            out = opt.ParameterOutput(p.name)
            if p.HasField("fp8"):
                mode, fmt = opt.quantized_names(p.fp8.config)
                out.fp8 = _quantized_from_proto(p.fp8, mode, fmt, as_torch)
            if p.HasField("bf16"):
                out.bf16 = tensor_from_proto(p.bf16, as_torch)
            params[p.name] = out
        return opt.StepResult(stats, params)

    def grad_norm(self, group, step, gradients, collective_group="", sequence=0, timeout=None,
                  request_id=None):
        """The first phase of a two-phase step: this group's share of the
        gradient norm of step `step` (the group's step + 1, or its step to
        retry a processed one), nothing changed. gradients as for step().
        Returns a GradNormResult; add .sum_squares and or .non_finite over
        every group of every rank, then call step(..., clip_factor=
        qtx.clip_factor(total, max_grad_norm), skip=any_non_finite) on each.
        collective_group / sequence: let the sidecars of that Collective
        group add the contributions among themselves (every rank calls with
        the same step and sequence, the group's call counter shared with
        all_gather); the result then carries total_sum_squares,
        total_non_finite and ranks, the same on every rank."""
        items = list(gradients.items() if hasattr(gradients, "items") else gradients)
        req = optimizer_pb2.GradNormRequest(group=group, step=step,
                                            collective_group=collective_group, sequence=sequence)
        for name, g in items:
            req.gradients.add(name=name, grad=opt.state_tensor_to_proto(
                g, "gradient %s" % name, tensor_to_proto, _is_torch))
        resp = self._call(self.optimizer.GradNorm, req, timeout, request_id)
        return opt.GradNormResult(step=resp.step, sum_squares=resp.sum_squares,
                                  non_finite=resp.non_finite, grad_norm=resp.grad_norm,
                                  step_processed=resp.step_processed,
                                  total_sum_squares=resp.total_sum_squares,
                                  total_non_finite=resp.total_non_finite, ranks=resp.ranks)

    def get_state(self, group, names=None, include_moments=False, timeout=None,
                  request_id=None):
        """The group's OptimizerGroupInfo and the FP32 master weights (and with
        include_moments the moments, in the moment dtype: uint16 bits for
        bfloat16) of `names` (default: every parameter), as numpy arrays:
        an OptimizerState with .group and .parameters {name: ParameterState}.
        A sharded parameter's master and moments are its owned slice, 1-D."""
        if isinstance(names, str):
            names = [names]
        req = optimizer_pb2.GetStateRequest(group=group, names=list(names or []),
                                            include_moments=include_moments)
        resp = self._call(self.optimizer.GetState, req, timeout, request_id)
        params = {}
        for p in resp.parameters:
            st = opt.ParameterState(p.name, tensor_from_proto(p.master))
            if p.HasField("exp_avg"):
                st.exp_avg = tensor_from_proto(p.exp_avg)
            if p.HasField("exp_avg_sq"):
                st.exp_avg_sq = tensor_from_proto(p.exp_avg_sq)
            params[p.name] = st
        return opt.OptimizerState(opt.group_from_proto(resp.group), params)

    def optimizer_state_dict(self, group, timeout=None):
        """The group's state in torch.optim.AdamW.state_dict()'s form: a dict
        that torch.optim.AdamW.load_state_dict takes (state: step, exp_avg,
        exp_avg_sq per parameter index; param_groups: lr, betas, eps,
        weight_decay, params, param_names, one per distinct per-parameter
        weight decay / lr scale), plus "master_weights" {index: float32
        tensor} and "qtx" {lr, weight_decay}. Needs torch. Layout and rules:
        client/README.md (PyTorch section); qtx.optimizer.torch_state_dict."""
        return opt.torch_state_dict(self.get_state(group, include_moments=True,
                                                   timeout=timeout))

    def load_optimizer_state_dict(self, group, state_dict, parameters=None, replace=True,
                                  timeout=None, **output):
        """Offloads `group` from a torch.optim.AdamW-style state_dict (one of
        optimizer_state_dict, or torch's own; with replace=True, the default,
        an existing group of that name is replaced, like load_state_dict
        replaces an optimizer's state) and returns its OptimizerGroupInfo.
        parameters: the master weights by name ({name: tensor} or (name,
        tensor) pairs such as model.named_parameters(), in the optimizer's
        parameter order when state_dict has no "param_names"); default:
        state_dict["master_weights"]. output: offload_optimizer_state's
        storage and output arguments (moment_dtype, output, mode, format,
        rowwise, columnwise, pow2_scales, amax_epsilon, bf16_copy,
        request_id); the AdamW settings and the step come from state_dict
        (qtx.optimizer.from_torch_state_dict; rules in client/README.md)."""
        allowed = {"moment_dtype", "output", "mode", "format", "rowwise", "columnwise",
                   "pow2_scales", "amax_epsilon", "bf16_copy", "request_id"}
        extra = sorted(set(output) - allowed)
        if extra:
            raise TypeError("load_optimizer_state_dict: unexpected arguments %s (the AdamW "
                            "settings come from state_dict; allowed: %s)" % (extra, sorted(allowed)))
        lr, betas, eps, weight_decay, step, params = opt.from_torch_state_dict(state_dict,
                                                                               parameters)
        return self.offload_optimizer_state(group, params, lr=lr, betas=betas, eps=eps,
                                            weight_decay=weight_decay, bias_correction=True,
                                            step=step, replace=replace, timeout=timeout,
                                            **output)

    def save_checkpoint(self, group="", timeout=None, request_id=None):
        """Checkpoints `group` (empty: every group) into qtxd's
        --checkpoint_dir; a list of CheckpointInfo (group, step, path, bytes)."""
        resp = self._call(self.optimizer.SaveCheckpoint,
                          optimizer_pb2.SaveCheckpointRequest(group=group), timeout, request_id)
        return [opt.CheckpointInfo(c.group, c.step, c.path, c.bytes) for c in resp.checkpoints]

    def load_checkpoint(self, group, previous=False, timeout=None, request_id=None,
                        sources=None, shards=None):
        """Replaces the group's state with its checkpoint (previous=True: the
        one before it, '<group>.qtxopt.prev'); returns its OptimizerGroupInfo.

        Resharding (another data-parallel size): sources = every old owner's
        checkpoint file of the group (absolute paths under qtxd's
        --checkpoint_dir or --checkpoint_import_dirs), shards = {name:
        (begin, end)}, this sidecar's new ranges (parameters not named are
        loaded whole; none: an unsharded group). Call it on every new owner
        with the same sources, then save_checkpoint on each."""
        req = optimizer_pb2.LoadCheckpointRequest(group=group, previous=previous)
        if shards and not sources:
            raise ValueError("shards= needs sources= (the old owners' checkpoint files)")
        for path in sources or ():
            req.sources.append(str(path))
        for name, rng in (shards or {}).items():
            try:
                begin, end = (int(v) for v in rng)
            except (TypeError, ValueError):
                raise ValueError("shards[%r]=%r: must be a (begin, end) pair of integers"
                                 % (name, rng)) from None
            s = req.shards.add(name=str(name))
            s.range.begin, s.range.end = begin, end
        resp = self._call(self.optimizer.LoadCheckpoint, req, timeout, request_id)
        return opt.group_from_proto(resp.group)

    def release_group(self, group, timeout=None, request_id=None):
        """Drops an optimizer group, frees its host memory and deletes its checkpoints."""
        self._call(self.optimizer.ReleaseGroup, optimizer_pb2.ReleaseGroupRequest(group=group),
                   timeout, request_id)

    def list_optimizer_groups(self, timeout=None):
        """Every optimizer group (unusable ones carry .error) and qtxd's memory
        cap: an OptimizerGroupList."""
        resp = self._call(self.optimizer.ListGroups, optimizer_pb2.ListOptimizerGroupsRequest(),
                          timeout)
        return opt.OptimizerGroupList([opt.group_from_proto(g) for g in resp.groups],
                                      resp.memory_limit_bytes, resp.memory_used_bytes)


def _quantize_config(mode, format, rowwise, columnwise, pow2_scales, amax_epsilon):
    if mode not in _MODES:
        raise ValueError("mode=%r: must be one of %s" % (mode, sorted(_MODES)))
    if format not in _FORMATS:
        raise ValueError("format=%r: must be one of %s" % (format, sorted(_FORMATS)))
    return quantizer_pb2.QuantizeConfig(
        scaling_mode=_MODES[mode], format=_FORMATS[format], rowwise=rowwise,
        columnwise=columnwise, force_pow2_scales=pow2_scales, amax_epsilon=amax_epsilon)


def _bytes_to_proto(x, format):
    """An inline FP8 TensorRef of a uint8 array (or torch uint8 / float8 tensor)."""
    if isinstance(x, tensor_pb2.TensorRef):
        return x
    if _is_torch(x):
        x = x.detach().to("cpu").contiguous().view(torch.uint8).numpy()
    a = np.ascontiguousarray(x)
    if a.dtype != np.uint8:
        raise TypeError("dtype %s: FP8 bytes must be uint8" % a.dtype)
    dt = tensor_pb2.FLOAT8_E5M2 if format == "e5m2" else tensor_pb2.FLOAT8_E4M3
    return tensor_pb2.TensorRef(dtype=dt, shape=list(a.shape), inline_data=a.tobytes())


def _scale_to_proto(x):
    if isinstance(x, tensor_pb2.TensorRef):
        return x
    if _is_torch(x):
        x = x.detach().to("cpu").contiguous().numpy()
    a = np.ascontiguousarray(x, dtype=np.float32)
    return tensor_pb2.TensorRef(dtype=tensor_pb2.FLOAT32, shape=list(a.shape),
                                inline_data=a.tobytes())


def _quantized_from_proto(r, mode, format, as_torch):
    out = QuantizedTensor(shape=tuple(r.shape), mode=mode, format=format, proto=r)
    for field in ("rowwise_data", "rowwise_scale_inv", "columnwise_data",
                  "columnwise_scale_inv"):
        if r.HasField(field):
            setattr(out, field, tensor_from_proto(getattr(r, field), as_torch))
    return out


# ---- tensor conversion ----------------------------------------------------------------------


def tensor_to_proto(x):
    """A qtx.v1.TensorRef (inline) for a numpy array or torch tensor; a
    TensorRef passes through unchanged."""
    if isinstance(x, tensor_pb2.TensorRef):
        return x
    if _is_torch(x):
        t = x.detach().to("cpu").contiguous()
        if t.dtype == torch.bfloat16:
            raw = t.view(torch.int16).numpy().tobytes()
            return tensor_pb2.TensorRef(dtype=tensor_pb2.BFLOAT16, shape=list(t.shape),
                                        inline_data=raw)
        x = t.numpy()
    a = np.ascontiguousarray(x)
    if a.dtype not in _NP_DTYPES:
        raise TypeError("dtype %s: qtx quantizes float32, float16 (numpy) or bfloat16 (torch)"
                        % a.dtype)
    return tensor_pb2.TensorRef(dtype=_NP_DTYPES[a.dtype], shape=list(a.shape),
                                inline_data=a.tobytes())


_FROM_PROTO = {tensor_pb2.FLOAT32: np.float32, tensor_pb2.FLOAT16: np.float16,
               tensor_pb2.BFLOAT16: np.uint16, tensor_pb2.FLOAT8_E4M3: np.uint8,
               tensor_pb2.FLOAT8_E5M2: np.uint8, tensor_pb2.UINT8: np.uint8}


def tensor_from_proto(ref, as_torch=False):
    """numpy array (or torch tensor) of an inline TensorRef; a region tensor
    is returned as its TensorRef (its bytes are in the region)."""
    if ref.WhichOneof("data") != "inline_data":
        return ref
    a = np.frombuffer(ref.inline_data, dtype=_FROM_PROTO[ref.dtype]).reshape(tuple(ref.shape))
    if as_torch:
        if ref.dtype == tensor_pb2.BFLOAT16:
            return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
        return torch.from_numpy(a.copy())
    return a


# grpc.health.v1 messages, encoded by hand (no generated health stubs needed).
def _encode_health_request(service):
    raw = service.encode()
    if not raw:
        return b""
    assert len(raw) < 128
    return b"\x0a" + bytes([len(raw)]) + raw


def _decode_health_response(data):
    status = 0
    if len(data) >= 2 and data[0] == 0x08:
        status = data[1]
    return {1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}.get(status, "UNKNOWN")
