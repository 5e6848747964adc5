"""The job dashboard: static pages served by the job API and the JSON endpoints they read (`api.mount_dashboard`)."""
