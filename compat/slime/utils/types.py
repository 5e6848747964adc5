"""slime.utils.types: `Sample` is the class the Physarum services hand to plugins (all of slime's fields, defaults
and methods), so `isinstance(sample, Sample)` holds for what a plugin receives."""

from services.common.plugin_sample import PluginSample as Sample
from services.common.plugin_sample import PrefixCacheInfo, SpecInfo

__all__ = ["PrefixCacheInfo", "Sample", "SpecInfo"]
