"""Structured outputs: generation constrained to a JSON schema, JSON, a regex, a choice or an EBNF grammar.

Built on xgrammar (vLLM's default backend). `StructuredOutputsParams` (in SamplingParams) says what to
follow; `GrammarCompiler` turns it into a compiled grammar, refusing invalid specs with a ValueError that
names the problem; `StructuredOutputs` holds one matcher per constrained request, masks each step's logits
to the tokens the grammar allows and advances the matchers with the sampled tokens.
"""

from engine.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
