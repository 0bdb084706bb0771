"""The office: keys, quotas, the ledger, conversations; what one server shares across its models."""
