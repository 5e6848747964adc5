"""slime's agent surface (`slime.agent`) on Physarum's agent gateway: adapters whose sessions are gateway sessions."""
