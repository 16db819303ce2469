"""The API that ultractl and peers call: the admin service, authentication, events, metrics."""
