"""Launchers: local processes (launch/local.py); Ray placement groups to come."""
