"""Integrations with model libraries. Each lives in its own module and imports its library
only when that module is imported:

    sparse_framework.integrations.transformers   Hugging Face transformers (`enable`, `sparse`)
"""
