"""The load-time weight transforms of a rank's model: every `nn.Linear` routed through the op
`asyncexec::packed_linear` (`asyncexec.ops.packed_linear`) with its weight prepacked for oneDNN, or
quantized to int8 (`int8`: activation-aware scales) or int4 (`int4`: Q4_1's layout); see `pack`.
Nothing is imported here: a module is loaded when it is first used.
"""
