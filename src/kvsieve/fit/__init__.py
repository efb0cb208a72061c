"""Offline fitting of methods that need a training stage (SAAP: ``kvsieve fit saap``)."""
