"""Who is calling and what they may use: API keys to tenants, tenant policies and their limits."""
