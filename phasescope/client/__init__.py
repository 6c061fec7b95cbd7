"""The client side: typed blocking and asyncio clients over the generated stubs, and `top`'s view."""
