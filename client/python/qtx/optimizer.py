"""Value types of the qtx.Client Optimizer calls (qtx.v1.Optimizer).

They mirror the C++ client's qtx/optimizer_types.h as dataclasses; the
semantics (AdamW as torch.optim.AdamW in the operation order of
kernels/adamw.h, idempotent step numbers, atomic checkpoints) are those of
proto/qtx/v1/optimizer.proto. Every type keeps the message it came from in
``proto`` where there is one.

The argument helpers (per_parameter) serve qtx.cuda too, which runs without
grpcio and protobuf: this module imports without the generated stubs, and
only the proto conversions need them.
"""

import dataclasses
import math

import numpy as np

try:  # the generated stubs; absent on a qtx.cuda-only host
    from qtx.v1 import optimizer_pb2, quantizer_pb2, tensor_pb2
except ImportError:
    optimizer_pb2 = quantizer_pb2 = tensor_pb2 = None

if optimizer_pb2 is not None:
    MOMENT_DTYPES = {"float32": optimizer_pb2.MOMENT_DTYPE_FLOAT32,
                     "bfloat16": optimizer_pb2.MOMENT_DTYPE_BFLOAT16}
    OUTPUTS = {"fp8": optimizer_pb2.PARAMETER_FORMAT_FP8,
               "bf16": optimizer_pb2.PARAMETER_FORMAT_BF16}
    _MODE_NAMES = {quantizer_pb2.BLOCK_1D: "1d", quantizer_pb2.BLOCK_2D: "2d",
                   quantizer_pb2.TENSOR: "tensor"}
    _FORMAT_NAMES = {quantizer_pb2.E4M3: "e4m3", quantizer_pb2.E5M2: "e5m2"}


@dataclasses.dataclass
class ParameterInit:
    """One parameter handed to offload_optimizer_state. ``master``: FP32
    master weights as a numpy float32 array, bfloat16 bits as a numpy uint16
    array, a torch float32/bfloat16 tensor or a qtx.v1.TensorRef. The moments
    (same dtypes, both or neither) take over a running job; absent: zeros.
    ``shape`` defaults to master's. ``weight_decay`` / ``lr_scale``: this
    parameter's own AdamW settings (its lr is the step's times lr_scale);
    None: the group's weight decay, scale 1. ``shard``: (begin, end), a
    data-parallel sharded parameter of which this sidecar owns elements
    [begin, end) of the flattened whole parameter; ``shape`` (required then)
    is the whole parameter's and master / moments hold the end - begin owned
    elements (e.g. 1-D)."""
    name: str
    master: object
    exp_avg: object = None
    exp_avg_sq: object = None
    shape: tuple = None
    weight_decay: float = None
    lr_scale: float = None
    shard: tuple = None


@dataclasses.dataclass
class AdamWHyperParams:
    """torch.optim.AdamW's hyper-parameters (and defaults)."""
    lr: float = 1e-3
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    bias_correction: bool = True


@dataclasses.dataclass
class ParameterOutputConfig:
    """How step() returns the parameters: output 'fp8' (mode '2d', '1d' or 'tensor',
    format 'e4m3' or 'e5m2', the rowwise/columnwise copies, pow2 scales,
    amax_epsilon; bf16_copy adds a BF16 copy) or 'bf16' only."""
    output: str = "fp8"
    mode: str = "2d"
    format: str = "e4m3"
    rowwise: bool = True
    columnwise: bool = True
    pow2_scales: bool = True
    amax_epsilon: float = 0.0
    bf16_copy: bool = False


@dataclasses.dataclass
class OptimizerGroupInfo:
    """A group as qtxd describes it."""
    name: str
    step: int                   # steps processed
    update_count: int           # steps applied (AdamW's t); <= step
    num_parameters: int
    num_elements: int
    state_bytes: int            # host bytes of master weights + moments
    moment_dtype: str           # 'float32' or 'bfloat16'
    hyper_params: AdamWHyperParams
    output: ParameterOutputConfig
    last_checkpoint_step: int   # -1 when never checkpointed
    error: str                  # non-empty: the group is unusable (e.g. corrupted checkpoint)
    proto: object = None        # the qtx.v1.OptimizerGroupInfo
    # {name: (weight_decay, lr_scale)} of the parameters with their own settings
    parameter_hyper_params: dict = dataclasses.field(default_factory=dict)
    # {name: (begin, end)} of the parameters offloaded with a shard range (a
    # data-parallel sharded group); num_elements / state_bytes count owned elements
    parameter_shards: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class OptimizerGroupList:
    groups: list                # OptimizerGroupInfo, sorted by name
    memory_limit_bytes: int
    memory_used_bytes: int


@dataclasses.dataclass
class StepStats:
    step: int           # the step this result belongs to
    grad_norm: float    # L2 norm of the group's gradients before clipping (0 with clip_factor/skip)
    skipped: bool       # the update was not applied
    non_finite: bool    # some gradient element was NaN or Inf
    clip_coef: float    # the factor applied to the gradients (1 = none; clip_factor if given)
    lr: float           # the learning rate used
    replayed: bool      # answered from a previous application of this step


@dataclasses.dataclass
class GradNormResult:
    """One group's share of the gradient norm of a step (Client.grad_norm):
    add sum_squares and or non_finite over every group of every rank, then
    step() with clip_factor=clip_factor(total, max_grad_norm) and skip."""
    step: int
    sum_squares: float    # every gradient element squared, summed as a one-phase step sums them
    non_finite: bool      # NaN/Inf in a gradient (or the sum overflowed)
    grad_norm: float      # sqrt(sum_squares), this group alone
    step_processed: bool  # a retry of a processed step: its step() replays
    # With collective_group: the totals over every rank (same bits on each) and their count
    total_sum_squares: float = 0.0
    total_non_finite: bool = False
    ranks: int = 0


def clip_factor(total_sum_squares, max_grad_norm):
    """The factor torch.nn.utils.clip_grad_norm_ applies for a total norm of
    sqrt(total_sum_squares): min(1, max_grad_norm / (norm + 1e-6)), in double
    exactly as a one-phase step with max_grad_norm computes it."""
    coef = max_grad_norm / (math.sqrt(total_sum_squares) + 1e-6)
    return coef if coef < 1.0 else 1.0


@dataclasses.dataclass
class ParameterOutput:
    name: str
    fp8: object = None   # qtx.QuantizedTensor (output 'fp8')
    bf16: object = None  # bfloat16 bits as numpy uint16 (or a torch bfloat16 tensor)


@dataclasses.dataclass
class StepResult:
    stats: StepStats
    parameters: dict     # name -> ParameterOutput, in the group's order; empty with omit_parameters


@dataclasses.dataclass
class ParameterState:
    name: str
    master: object              # numpy float32, the parameter's shape
    exp_avg: object = None      # float32, or uint16 bfloat16 bits (with include_moments)
    exp_avg_sq: object = None


@dataclasses.dataclass
class OptimizerState:
    group: OptimizerGroupInfo
    parameters: dict     # name -> ParameterState, in the group's order


@dataclasses.dataclass
class CheckpointInfo:
    group: str
    step: int
    path: str
    bytes: int


# ---- conversions ------------------------------------------------------------------------------


def choice(value, table, what):
    if value not in table:
        raise ValueError("%s=%r: must be one of %s" % (what, value, sorted(table)))
    return table[value]


def hyper_to_proto(h, out):
    beta1, beta2 = h.betas
    out.lr, out.beta1, out.beta2 = h.lr, beta1, beta2
    out.eps, out.weight_decay, out.bias_correction = h.eps, h.weight_decay, h.bias_correction


def output_to_proto(o, out, quantize_config):
    out.format = choice(o.output, OUTPUTS, "output")
    # Every field explicit, as the C++ client sends it: no server defaults apply.
    out.fp8.CopyFrom(quantize_config(o.mode, o.format, o.rowwise, o.columnwise, o.pow2_scales,
                                     o.amax_epsilon))
    out.bf16_copy = o.bf16_copy


def group_from_proto(p):
    h = p.hyper_params
    hp = AdamWHyperParams()
    if h.HasField("lr"):
        hp.lr = h.lr
    if h.HasField("beta1") or h.HasField("beta2"):
        hp.betas = (h.beta1 if h.HasField("beta1") else hp.betas[0],
                    h.beta2 if h.HasField("beta2") else hp.betas[1])
    if h.HasField("eps"):
        hp.eps = h.eps
    if h.HasField("weight_decay"):
        hp.weight_decay = h.weight_decay
    if h.HasField("bias_correction"):
        hp.bias_correction = h.bias_correction
    f = p.output.fp8
    out = ParameterOutputConfig(
        output="bf16" if p.output.format == optimizer_pb2.PARAMETER_FORMAT_BF16 else "fp8",
        mode=_MODE_NAMES.get(f.scaling_mode, "2d"), format=_FORMAT_NAMES.get(f.format, "e4m3"),
        rowwise=f.rowwise if f.HasField("rowwise") else True,
        columnwise=f.columnwise if f.HasField("columnwise") else True,
        pow2_scales=f.force_pow2_scales if f.HasField("force_pow2_scales") else True,
        amax_epsilon=f.amax_epsilon, bf16_copy=p.output.bf16_copy)
    return OptimizerGroupInfo(
        name=p.name, step=p.step, update_count=p.update_count, num_parameters=p.num_parameters,
        num_elements=p.num_elements, state_bytes=p.state_bytes,
        moment_dtype="bfloat16" if p.moment_dtype == optimizer_pb2.MOMENT_DTYPE_BFLOAT16
        else "float32",
        hyper_params=hp, output=out, last_checkpoint_step=p.last_checkpoint_step, error=p.error,
        proto=p, parameter_hyper_params={h.name: (h.weight_decay, h.lr_scale)
                                         for h in p.parameter_hyper_params},
        parameter_shards={s.name: (s.range.begin, s.range.end) for s in p.parameter_shards})


def quantized_names(config):
    """(mode, format) strings of a QuantizeConfig."""
    return (_MODE_NAMES.get(config.scaling_mode, "1d"),
            _FORMAT_NAMES.get(config.format, "e4m3"))


def state_tensor_to_proto(x, what, tensor_to_proto, is_torch):
    """A TensorRef for optimizer state or gradients: numpy float32 / float16,
    numpy uint16 (bfloat16 bits), torch float32 / bfloat16 / float16, or a
    TensorRef. The server checks which dtypes the field accepts."""
    if isinstance(x, tensor_pb2.TensorRef) or is_torch(x):
        return tensor_to_proto(x)
    a = np.ascontiguousarray(x)
    if a.dtype == np.uint16:
        return tensor_pb2.TensorRef(dtype=tensor_pb2.BFLOAT16, shape=list(a.shape),
                                    inline_data=a.tobytes())
    if a.dtype not in (np.float32, np.float16):
        raise TypeError("%s: dtype %s: must be float32, float16 or bfloat16 bits as uint16"
                        % (what, a.dtype))
    return tensor_to_proto(a)


def per_parameter(values, names, what):
    """{name: value} from a per-parameter argument: None, a {name: value}
    mapping (any subset of the parameters) or a sequence with one value (or
    None) per parameter, in order. ValueError naming `what` otherwise. The
    one check of weight_decays / lr_scales for qtx.Client and qtx.cuda."""
    if values is None:
        return {}
    if hasattr(values, "items"):
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise ValueError("%s: %s: not a parameter of the group (parameters: %s)"
                             % (what, unknown, list(names)))
        return {n: v for n, v in values.items() if v is not None}
    values = list(values)
    if len(values) != len(names):
        raise ValueError("%s: %d values for %d parameters; give one per parameter (None for the "
                         "group's) or a {name: value} dict" % (what, len(values), len(names)))
    return {n: v for n, v in zip(names, values) if v is not None}


def _element_count(x):
    """Elements of a master / moment argument: numpy, torch or a TensorRef."""
    shape = x.shape if hasattr(x, "shape") else np.shape(x)
    return int(np.prod(tuple(shape), dtype=np.int64)) if len(shape) else 1


def check_shard(p, shard):
    """(begin, end) of a shard range for ParameterInit `p` after checking it
    against the whole shape and the given master / moments (ValueError
    naming the parameter otherwise; qtxd checks the same)."""
    try:
        begin, end = (int(v) for v in shard)
    except (TypeError, ValueError):
        raise ValueError("parameter %s: shard=%r: must be a (begin, end) pair of integers"
                         % (p.name, shard)) from None
    if p.shape is None:
        raise ValueError("parameter %s: shard=(%d, %d) needs shape= (the whole parameter's "
                         "shape; master holds only the owned elements)" % (p.name, begin, end))
    total = int(np.prod(tuple(p.shape), dtype=np.int64)) if len(p.shape) else 1
    if not 0 <= begin <= end <= total:
        raise ValueError("parameter %s: shard=(%d, %d): must have 0 <= begin <= end <= %d (the "
                         "elements of shape %s)" % (p.name, begin, end, total, tuple(p.shape)))
    for what in ("master", "exp_avg", "exp_avg_sq"):
        x = getattr(p, what)
        if x is not None and _element_count(x) != end - begin:
            raise ValueError("parameter %s: %s has %d elements; shard=(%d, %d) owns %d"
                             % (p.name, what, _element_count(x), begin, end, end - begin))
    return begin, end


def parameters_from_arg(parameters):
    """A list of ParameterInit from a {name: master} mapping, ParameterInits
    or (name, master) pairs."""
    if hasattr(parameters, "items"):
        parameters = parameters.items()
    out = []
    for p in parameters:
        if isinstance(p, ParameterInit):
            out.append(p)
        else:
            name, value = p
            out.append(dataclasses.replace(value, name=name) if isinstance(value, ParameterInit)
                       else ParameterInit(name, value))
    return out


# ---- torch.optim.AdamW's state_dict form ------------------------------------------------------
#
# A group's state as torch.optim.AdamW.state_dict() writes it (Client.optimizer_state_dict,
# Client.load_optimizer_state_dict; client/README.md's PyTorch section):
#   "state":          {index: {"step": float32 scalar tensor (AdamW's t: updates applied),
#                              "exp_avg": tensor, "exp_avg_sq": tensor}}   (moment dtype)
#   "param_groups":   one torch param group per distinct (weight_decay, lr_scale) of the
#                     parameters, in order of first appearance: lr = group lr * lr_scale,
#                     weight_decay, betas, eps, torch's flags (defaults), "params" (indices),
#                     "param_names" (as torch >= 2.6 writes them) and "lr_scale" (qtx's);
#   "master_weights": {index: float32 tensor} (torch keeps these in the model instead);
#   "qtx":            {"lr", "weight_decay"}: the qtx group's own values.
# Indices run over the param groups in order (torch's numbering); torch ignores the two
# extra keys and the extra group keys.

TORCH_GROUP_FLAGS = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                     "differentiable": False, "fused": None, "decoupled_weight_decay": True}


def _torch_or_raise():
    try:
        import torch
    except ImportError as e:
        raise ImportError("the torch.optim.AdamW state_dict form needs torch (%s)" % e) from None
    return torch


def _to_torch(a, torch):
    """A torch tensor owning a copy of numpy `a` (uint16: bfloat16 bits)."""
    a = np.ascontiguousarray(a)
    if a.dtype == np.uint16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def torch_state_dict(state):
    """An OptimizerState (get_state with include_moments) in torch.optim.AdamW's
    state_dict form (see above). ValueError for a group without bias
    correction, which torch's AdamW cannot express."""
    g = state.group
    hp = g.hyper_params
    if g.parameter_shards:
        raise ValueError("group %r: data-parallel sharded (parameter_shards %s): torch's "
                         "state_dict form has no element ranges; use get_state on every owner"
                         % (g.name, g.parameter_shards))
    torch = _torch_or_raise()
    if not hp.bias_correction:
        raise ValueError("group %r: bias_correction=False; torch.optim.AdamW always corrects the "
                         "bias, so its state_dict cannot describe this group" % g.name)
    groups = {}  # (weight_decay, lr_scale) -> [names], in order of first appearance
    for name in state.parameters:
        key = g.parameter_hyper_params.get(name, (hp.weight_decay, 1.0))
        groups.setdefault(tuple(float(v) for v in key), []).append(name)
    sd = {"state": {}, "param_groups": [], "master_weights": {},
          "qtx": {"lr": hp.lr, "weight_decay": hp.weight_decay}}
    index = 0
    for (wd, scale), names in groups.items():
        pg = {"lr": hp.lr * scale, "betas": tuple(hp.betas), "eps": hp.eps, "weight_decay": wd}
        pg.update(TORCH_GROUP_FLAGS)
        pg.update(params=list(range(index, index + len(names))), param_names=list(names),
                  lr_scale=scale)
        sd["param_groups"].append(pg)
        for name in names:
            p = state.parameters[name]
            if p.exp_avg is None or p.exp_avg_sq is None:
                raise ValueError("parameter %s: no moments (get_state(include_moments=True))"
                                 % name)
            sd["state"][index] = {"step": torch.tensor(float(g.update_count)),
                                  "exp_avg": _to_torch(p.exp_avg, torch),
                                  "exp_avg_sq": _to_torch(p.exp_avg_sq, torch)}
            sd["master_weights"][index] = _to_torch(p.master, torch)
            index += 1
    return sd


def _floats(v):
    """betas / eps as floats (torch also allows 0-d tensors): a tuple or a float."""
    if isinstance(v, (tuple, list)):
        return tuple(float(x) for x in v)
    return float(v)


def _step_number(value, what):
    if hasattr(value, "item"):
        value = value.item()
    t = float(value)
    if not (t >= 0 and t == int(t)):
        raise ValueError("%s: step %r is not a whole number >= 0" % (what, value))
    return int(t)


def _named_masters(parameters):
    """[(name, tensor)] from None, a {name: tensor} mapping or (name, tensor) pairs."""
    if parameters is None:
        return None
    items = list(parameters.items() if hasattr(parameters, "items") else parameters)
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise ValueError("parameters: a {name: tensor} dict or (name, tensor) pairs (e.g. "
                             "model.named_parameters()), got an item %r" % (type(item),))
    return items


def _scales(groups, qtx_lr):
    """The qtx group's lr and each param group's lr_scale: the groups'
    "lr_scale" values when a base lr (qtx_lr, else the lr of a group whose
    lr_scale is 1) times them still gives every group's lr exactly (the
    groups come from torch_state_dict, and their lrs were not changed since);
    else lr_scale = group lr / the first group's lr (the largest if that is 0)."""
    lrs = [float(pg["lr"]) for pg in groups]
    if all("lr_scale" in pg for pg in groups):
        scales = [float(pg["lr_scale"]) for pg in groups]
        bases = [] if qtx_lr is None else [float(qtx_lr)]
        bases += [lr for lr, s in zip(lrs, scales) if s == 1.0]
        for base in bases:
            if all(base * s == lr for s, lr in zip(scales, lrs)):
                return base, scales
    base = lrs[0] if lrs[0] > 0 else max(lrs)
    if base == 0:
        return 0.0, [1.0] * len(lrs)
    return base, [lr / base for lr in lrs]


def from_torch_state_dict(state_dict, parameters=None):
    """The inverse of torch_state_dict, for torch.optim.AdamW's own
    state_dict too: (lr, betas, eps, weight_decay, step, [ParameterInit]) for
    offload_optimizer_state. Parameter names come from the param groups'
    "param_names", else from `parameters` ({name: tensor} or (name, tensor)
    pairs in torch's parameter order: group by group as the optimizer was
    built); master weights from `parameters` when given (by name), else from
    state_dict["master_weights"]. Every parameter must have state with one
    common step, or none may (a fresh optimizer: step 0, zero moments).
    ValueError naming what cannot be mapped (amsgrad, maximize, Adam's
    coupled weight decay, betas or eps differing between groups, ...)."""
    try:
        state, groups = state_dict["state"], [pg for pg in state_dict["param_groups"]
                                              if len(pg["params"])]
    except (KeyError, TypeError):
        raise ValueError("state_dict: needs 'state' and 'param_groups' (an optimizer's "
                         "state_dict())") from None
    if not groups:
        raise ValueError("state_dict: no parameters in its param_groups")
    for k, pg in enumerate(groups):
        for flag, why in (("amsgrad", "qtx has no AMSGrad"),
                          ("maximize", "qtx minimizes")):
            if pg.get(flag, False):
                raise ValueError("param_groups[%d]: %s=True: %s" % (k, flag, why))
        if pg.get("decoupled_weight_decay", True) is False:
            raise ValueError("param_groups[%d]: decoupled_weight_decay=False (Adam's L2 "
                             "penalty): qtx runs AdamW" % k)
        for key in ("betas", "eps"):
            if _floats(pg[key]) != _floats(groups[0][key]):
                raise ValueError("param_groups[%d]: %s=%r differs from param_groups[0]'s %r; a "
                                 "qtx group has one" % (k, key, pg[key], groups[0][key]))
    masters = _named_masters(parameters)
    indices = [i for pg in groups for i in pg["params"]]
    if all("param_names" in pg for pg in groups):
        names = [n for pg in groups for n in pg["param_names"]]
    elif masters is not None:
        names = [n for n, _ in masters]
    else:
        raise ValueError("state_dict: no 'param_names' in its param_groups; pass parameters= "
                         "(name, tensor) pairs in the optimizer's parameter order")
    if len(names) != len(indices) or len(set(names)) != len(names):
        raise ValueError("%d parameter names (%d distinct) for %d parameters"
                         % (len(names), len(set(names)), len(indices)))
    by_name = dict(masters) if masters is not None else None
    saved = state_dict.get("master_weights")
    qtx_info = state_dict.get("qtx") or {}
    lr, scales = _scales(groups, qtx_info.get("lr"))
    weight_decay = float(qtx_info.get("weight_decay", groups[0]["weight_decay"]))
    with_state = [i for i in indices if state.get(i)]
    if with_state and len(with_state) != len(indices):
        missing = [n for n, i in zip(names, indices) if not state.get(i)]
        raise ValueError("parameters %s have no optimizer state while others have: a qtx group "
                         "steps every parameter together" % missing)
    steps = {_step_number(state[i]["step"], "parameter %s" % n)
             for n, i in zip(names, indices) if state.get(i)}
    if len(steps) > 1:
        raise ValueError("the parameters' steps differ (%s); a qtx group has one step"
                         % sorted(steps))
    params, k = [], 0
    for pg, scale in zip(groups, scales):
        wd = float(pg["weight_decay"])
        for i in pg["params"]:
            name = names[k]
            k += 1
            if by_name is not None:
                if name not in by_name:
                    raise ValueError("parameters: no tensor named %r" % name)
                master = by_name[name]
            elif saved is not None and i in saved:
                master = saved[i]
            else:
                raise ValueError("parameter %s: no master weights (pass parameters=, or a "
                                 "state_dict with 'master_weights')" % name)
            st = state.get(i) or {}
            params.append(ParameterInit(
                name, master, st.get("exp_avg"), st.get("exp_avg_sq"),
                weight_decay=wd if wd != weight_decay else None,
                lr_scale=scale if scale != 1.0 else None))
    return (lr, _floats(groups[0]["betas"]), float(groups[0]["eps"]), weight_decay,
            steps.pop() if steps else 0, params)
