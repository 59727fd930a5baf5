"""The neuronx-cc error codes a compile log can carry, each with a one-line meaning and a fix.

Codes are `NCC_` + a family of three or four capital letters + three digits (`NCC_EVRF001`,
`NCC_CFG015`). The table covers every code of the Neuron compiler error-code reference
(compiler/error-codes/index, Neuron SDK 2.32), paraphrased, plus the codes the 2.31 / 2.32
compiler release notes name for fixed compiler failures. Fixes say what to change in the model
or in portable's lowering; `portable check DIR` names the HLO instruction and the model line.
"""

from __future__ import annotations

import re

__all__ = ["CODE", "NCC_CODES", "UNKNOWN_CODE"]

CODE = re.compile(r"\bNCC_[A-Z]{3,4}[0-9]{3}\b")
UNKNOWN_CODE = (
    "a code portable has no explanation for",
    "look the code up in the Neuron compiler's error-code reference (compiler/error-codes)",
)

_SPLIT = (
    "make the program smaller: split it into pipeline stages or shard it with tensor parallelism"
)
_HBM = "reduce batch or sequence length, or shard with tensor / pipeline parallelism"
_CHECK = "`portable check DIR` names the instruction and the model line"
_CUSTOM_CALL = (
    "only the allow-listed custom calls may reach neuronx-cc (validate.ALLOWED_CUSTOM_CALLS); "
    + _CHECK
)
_MX_CALL = "the MX custom call is malformed: " + _CHECK + "; lower with NeuronOptions(mx='emulate')"
_INTEGER = (
    "keep the integer operands below 2^24 or compute in float32; command.txt pins "
    "--implicit-integer-downcast=all, which allows the lossy FP32 fallback"
)
_INTERNAL = (
    "a compiler failure fixed in a later neuronx-cc: upgrade the Neuron SDK, else report it "
    "with the log and model/graph.hlo"
)
_FP8 = "use an FP8 format of the target (docs/backends/neuron.md, Targets) or bf16"

# code -> (what it means, what to do)
NCC_CODES: dict[str, tuple[str, str]] = {
    "NCC_EARG001": (
        "the logical NeuronCore configuration is not supported by the target",
        "use --logical-nc-config=2 on trn2/trn3 (equal to the runtime's "
        "NEURON_LOGICAL_NC_CONFIG) and omit it for trn1/inf2",
    ),
    "NCC_EBIR023": (
        "an MLP kernel's intermediate size is above the supported 4096",
        "shard the intermediate dim with more tensor parallelism, or tile it in the kernel",
    ),
    "NCC_EBVF030": ("the generated instructions exceed the compiler's limit", _SPLIT),
    "NCC_EHCA005": ("a custom call whose target the compiler does not recognise", _CUSTOM_CALL),
    "NCC_EMOD025": (
        "a dynamic shape: every tensor dimension must be static",
        "capture with static shapes, one program per shape bucket",
    ),
    "NCC_EOOM001": ("the activations need more device memory (HBM) than a core has", _HBM),
    "NCC_EOOM002": ("the activations need more device memory (HBM) than a core has", _HBM),
    "NCC_ESFH002": (
        "an unsigned 64-bit integer constant that does not fit in 32 bits",
        "use 32-bit integers (int32 / uint32) for that value, or avoid the large constant",
    ),
    "NCC_ESPP004": (
        "a data type code generation does not support (e.g. raw float4_e2m1fn)",
        "use a supported type (bf16, fp32, the target's FP8)",
    ),
    "NCC_ESPP047": ("an FP8 data type the target does not support", _FP8),
    "NCC_EUOC002": (
        "an operator the compiler does not support",
        "rewrite it with supported ops (`neuronx-cc list-operators --framework XLA`); " + _CHECK,
    ),
    "NCC_EVRF001": (
        "an operator the compiler does not support",
        "rewrite it with supported ops (`neuronx-cc list-operators --framework XLA`); " + _CHECK,
    ),
    "NCC_EVRF004": (
        "a complex data type where the compiler has none (complex128; complex64 off the "
        "operations Neuron 2.32 supports)",
        "split complex values into real and imaginary float parts",
    ),
    "NCC_EVRF005": (
        "an FP8 *FNUZ data type (F8E4M3FNUZ, F8E4M3B11FNUZ, F8E5M2FNUZ)",
        "use the target's FP8 (float8_e4m3fn / float8_e4m3 / float8_e5m2) or bf16",
    ),
    "NCC_EVRF006": (
        "rng-bit-generator with an algorithm other than the default",
        "use the default RNG algorithm (JAX: the `rbg` PRNG implementation)",
    ),
    "NCC_EVRF007": ("the generated instructions exceed the compiler's limit", _SPLIT),
    "NCC_EVRF009": ("the activations need more device memory (HBM) than a core has", _HBM),
    "NCC_EVRF010": (
        "a convolution with both input (lhs) and kernel (rhs) dilation",
        "dilate the input explicitly, then convolve with kernel dilation only",
    ),
    "NCC_EVRF011": (
        "a strided convolution with input (lhs) dilation",
        "drop the stride or the input dilation (upsample and downsample separately)",
    ),
    "NCC_EVRF013": (
        "TopK on integer inputs",
        "compute TopK on a float copy of the values (portable's neuron topk rule sorts instead)",
    ),
    "NCC_EVRF015": ("a custom call whose target the compiler does not recognise", _CUSTOM_CALL),
    "NCC_EVRF016": (
        "a scatter-reduce on integer or boolean data",
        "cast the scattered values and the destination to float32 or bf16",
    ),
    "NCC_EVRF017": (
        "a reduce-window with base (input) dilation",
        "use base dilation 1 (dilate the input explicitly first)",
    ),
    "NCC_EVRF018": (
        "a reduce-window with window dilation",
        "use window dilation 1 (gather the dilated elements explicitly first)",
    ),
    "NCC_EVRF019": (
        "a reduce-window over more (or fewer) than one input and one init value",
        "split it into one single-operand reduce-window per input",
    ),
    "NCC_EVRF022": (
        "an arithmetic right shift of a value that is not 32-bit",
        "convert the shifted value to int32 / uint32 before the shift",
    ),
    "NCC_EVRF031": (
        "a scatter whose indices go out of bounds",
        "make the iota / index range match the operand dim it indexes",
    ),
    "NCC_EVRF035": ("an integer matmul (dot), which has no integer datapath", _INTEGER),
    "NCC_EVRF036": ("QuantizeMX with invalid backend_config JSON", _MX_CALL),
    "NCC_EVRF037": ("QuantizeMX without exactly one operand", _MX_CALL),
    "NCC_EVRF038": ("QuantizeMX with a dim invalid for the input's rank", _MX_CALL),
    "NCC_EVRF039": ("QuantizeMX with a block_size other than 32", _MX_CALL),
    "NCC_EVRF040": ("QuantizeMX with a scale_method other than EMAX", _MX_CALL),
    "NCC_EVRF041": ("QuantizeMX on an input that is not BF16 or F16", _MX_CALL),
    "NCC_EVRF042": ("a malformed QuantizeMX (FP8 dtype or packed U32 output)", _MX_CALL),
    "NCC_EVRF043": ("a block-scaled matmul without exactly 4 operands", _MX_CALL),
    "NCC_EVRF044": ("a block-scaled matmul whose LHS is not QuantizeMX's packed U32", _MX_CALL),
    "NCC_EVRF045": ("a block-scaled matmul with a result other than F32 / BF16", _MX_CALL),
    "NCC_EVRF046": ("a block-scaled matmul with an LHS of rank below 2", _MX_CALL),
    "NCC_EVRF047": ("a block-scaled matmul with an RHS of rank below 2", _MX_CALL),
    "NCC_EVRF048": ("a block-scaled matmul whose batch dims do not match", _MX_CALL),
    "NCC_EVRF049": ("a block-scaled matmul whose backend_config does not parse", _MX_CALL),
    "NCC_EVRF050": ("a block-scaled matmul whose contracting dims differ in size", _MX_CALL),
    "NCC_EVRF051": (
        "float8_e4m3fn on Trn1/Trn2 (Trn3 and later only)",
        "target trn3, or use float8_e4m3 / float8_e5m2 on trn1/trn2",
    ),
    "NCC_EVRF052": (
        "float8_e4m3 on hardware newer than Trn3",
        "use float8_e4m3fn",
    ),
    "NCC_EVRF053": ("a block-scaled matmul whose contracting and batch dims overlap", _MX_CALL),
    "NCC_EVRF054": ("a block-scaled matmul batch dim index out of range", _MX_CALL),
    "NCC_EVRF055": ("a block-scaled matmul contracting dim index out of range", _MX_CALL),
    "NCC_EVRF056": (
        "a gather with out-of-bounds indices (an iota longer than the dim it indexes)",
        "make the index range fit the table (e.g. max positions >= sequence length)",
    ),
    "NCC_EVRF057": ("QuantizeMX not returning a 2-tuple (data, scale)", _MX_CALL),
    "NCC_EVRF058": ("QuantizeMX on a dim not divisible by 4", _MX_CALL),
    "NCC_EVRF059": (
        "the kernel file an AwsNeuronCustomNativeKernel names is missing on the host",
        "retrace the NKI kernel, or copy its artifact where the compiler runs",
    ),
    "NCC_EVRF060": ("an integer scatter with compute, which has no integer datapath", _INTEGER),
    "NCC_EVRF061": ("an integer all-reduce, which reduces in FP32", _INTEGER),
    "NCC_EVRF062": (
        "an operation without an int64 datapath (power) on int64 operands",
        "keep the values below 2^31 or compute in int32; command.txt pins "
        "--implicit-integer-downcast=all, which allows the lossy int32 fallback",
    ),
    "NCC_EVRF063": ("an integer reduce-scatter, which reduces in FP32", _INTEGER),
    "NCC_EVRF064": (
        "the HLO fails XLA's shape verification (an illegal instruction)",
        "a lowering bug: report it with model/graph.hlo and the instruction the log names",
    ),
    "NCC_EVRF065": (
        "an NKI kernel traced with an unsupported NKI version",
        "upgrade NKI and retrace the kernel",
    ),
    "NCC_EXSP001": ("the activations need more device memory (HBM) than a core has", _HBM),
    "NCC_EXTP004": ("the generated instructions exceed the compiler's limit", _SPLIT),
    # named by the compiler release notes (2.31, 2.32) as failures fixed in those releases
    "NCC_CFG015": ("control-flow graph validation overflowed on a deeply nested model", _INTERNAL),
    "NCC_ESMP002": (
        "an index into a constant tensor out of bounds",
        "make the indices fit the constant's dims",
    ),
    "NCC_IBIR229": ("an SBUF tensor expanded beyond a partition's capacity", _INTERNAL),
    "NCC_INLA001": ("legalization of a many-dim access pattern failed", _INTERNAL),
    "NCC_IRPX902": ("loop predication on shard indices failed", _INTERNAL),
}
