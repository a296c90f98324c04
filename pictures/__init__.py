"""Pictures of jobs and fleets as self-contained HTML and inline SVG (stdlib only): the CLI's
`phalanx jobs report` and the server's `/ui` draw with the same code."""
