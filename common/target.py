"""Loading a target model and capturing its tap layers, shared by extraction and speculative decoding.

TEMPORARY: re-exports the implementation from `extract/` while that stage is being finished; the code
moves here (and `extract/` imports it from here) at integration, so `train/` never imports `extract/`.
"""

from extract.capture import TapHooks, layer_output  # noqa: F401
from extract.target import TAP_MEANING, Target, check_layer_ids, load_target, reach_text_parts  # noqa: F401
