"""Thin glue between training frameworks and the dtprofile engine (one module each)."""
