"""ONNX operator names of the default domain (the published spec, onnx 1.23.2).

The vocabulary rules match on; generated once from onnx.defs so that the
engine and the rule compiler need not import onnx.
"""

ONNX_OPS = frozenset({
    'Abs', 'Acos', 'Acosh', 'Add', 'AffineGrid', 'And', 'ArgMax', 'ArgMin', 'Asin', 'Asinh',
    'Atan', 'Atanh', 'Attention', 'AveragePool', 'BatchNormalization', 'Bernoulli', 'BitCast',
    'BitShift', 'BitwiseAnd', 'BitwiseNot', 'BitwiseOr', 'BitwiseXor', 'BlackmanWindow',
    'Cast', 'CastLike', 'CausalConvWithState', 'Ceil', 'Celu', 'CenterCropPad', 'Clip',
    'Col2Im', 'Compress', 'Concat', 'ConcatFromSequence', 'Constant', 'ConstantOfShape',
    'Conv', 'ConvInteger', 'ConvTranspose', 'Cos', 'Cosh', 'CumProd', 'CumSum', 'DFT',
    'DeformConv', 'DepthToSpace', 'DequantizeLinear', 'Det', 'Div', 'Dropout', 'DynamicQuantizeLinear',
    'Einsum', 'Elu', 'Equal', 'Erf', 'Exp', 'Expand', 'EyeLike', 'Flatten', 'Floor', 'GRU',
    'Gather', 'GatherElements', 'GatherND', 'Gelu', 'Gemm', 'GlobalAveragePool', 'GlobalLpPool',
    'GlobalMaxPool', 'Greater', 'GreaterOrEqual', 'GridSample', 'GroupNormalization', 'HammingWindow',
    'HannWindow', 'HardSigmoid', 'HardSwish', 'Hardmax', 'Identity', 'If', 'ImageDecoder',
    'InstanceNormalization', 'IsInf', 'IsNaN', 'LRN', 'LSTM', 'LayerNormalization', 'LeakyRelu',
    'Less', 'LessOrEqual', 'LinearAttention', 'Log', 'LogSoftmax', 'Loop', 'LpNormalization',
    'LpPool', 'MatMul', 'MatMulInteger', 'Max', 'MaxPool', 'MaxRoiPool', 'MaxUnpool', 'Mean',
    'MeanVarianceNormalization', 'MelWeightMatrix', 'Min', 'Mish', 'Mod', 'Mul', 'Multinomial',
    'Neg', 'NegativeLogLikelihoodLoss', 'NonMaxSuppression', 'NonZero', 'Not', 'OneHot',
    'Optional', 'OptionalGetElement', 'OptionalHasElement', 'Or', 'PRelu', 'Pad', 'Pow',
    'QLinearConv', 'QLinearMatMul', 'QuantizeLinear', 'RMSNormalization', 'RNN', 'RandomNormal',
    'RandomNormalLike', 'RandomUniform', 'RandomUniformLike', 'Range', 'Reciprocal', 'ReduceL1',
    'ReduceL2', 'ReduceLogSum', 'ReduceLogSumExp', 'ReduceMax', 'ReduceMean', 'ReduceMin',
    'ReduceProd', 'ReduceSum', 'ReduceSumSquare', 'RegexFullMatch', 'Relu', 'Reshape',
    'Resize', 'ReverseSequence', 'RoiAlign', 'RotaryEmbedding', 'Round', 'STFT', 'Scan',
    'Scatter', 'ScatterElements', 'ScatterND', 'Selu', 'SequenceAt', 'SequenceConstruct',
    'SequenceEmpty', 'SequenceErase', 'SequenceInsert', 'SequenceLength', 'SequenceMap',
    'Shape', 'Shrink', 'Sigmoid', 'Sign', 'Sin', 'Sinh', 'Size', 'Slice', 'Softmax', 'SoftmaxCrossEntropyLoss',
    'Softplus', 'Softsign', 'SpaceToDepth', 'Split', 'SplitToSequence', 'Sqrt', 'Squeeze',
    'StringConcat', 'StringNormalizer', 'StringSplit', 'Sub', 'Sum', 'SwiGLU', 'Swish',
    'Tan', 'Tanh', 'TensorScatter', 'TfIdfVectorizer', 'ThresholdedRelu', 'Tile', 'TopK',
    'Transpose', 'Trilu', 'Unique', 'Unsqueeze', 'Upsample', 'Where', 'Xor',
})

# (op, attribute) pairs of the default domain whose integer value is an element type: the IR
# holds a DType there (backends convert), so a rule writes a dtype name (`Cast(x, to=float32)`).
DTYPE_ATTRIBUTES = frozenset({
    ("Cast", "to"), ("EyeLike", "dtype"), ("RandomNormal", "dtype"), ("RandomUniform", "dtype"),
    ("RandomNormalLike", "dtype"), ("RandomUniformLike", "dtype"), ("Bernoulli", "dtype"),
    ("Multinomial", "dtype"),
})
