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
    _MODE_NAMES = {quantizer_pb2.BLOCK_1D: "1d", quantizer_pb2.BLOCK_2D: "2d"}
    _FORMAT_NAMES = {quantizer_pb2.E4M3: "e4m3", quantizer_pb2.E5M2: "e5m2"}


@dataclasses.dataclass
class ParameterInit:
    """One parameter handed to offload_optimizer_state. ``master``: FP32
    master weights as a numpy float32 array, bfloat16 bits as a numpy uint16
    array, a torch float32/bfloat16 tensor or a qtx.v1.TensorRef. The moments
    (same dtypes, both or neither) take over a running job; absent: zeros.
    ``shape`` defaults to master's. ``weight_decay`` / ``lr_scale``: this
    parameter's own AdamW settings (its lr is the step's times lr_scale);
    None: the group's weight decay, scale 1."""
    name: str
    master: object
    exp_avg: object = None
    exp_avg_sq: object = None
    shape: tuple = None
    weight_decay: float = None
    lr_scale: float = None


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
    """How step() returns the parameters: output 'fp8' (mode '2d' or '1d',
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
                                         for h in p.parameter_hyper_params})


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

