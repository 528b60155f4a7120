"""Integrations with model libraries. Each lives in its own module and imports its library
only when that module is imported:

    sparse_framework.integrations.transformers       Hugging Face transformers (`enable`, `sparse`),
                                                     a package: see its docstring
    sparse_framework.integrations.transformers.mla   MLA + DSA models (DeepSeek-V3.2, GLM-MoE-DSA):
                                                     `enable` imports it when it meets one
"""
