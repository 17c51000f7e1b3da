"""Stand-ins for services that cannot run on this machine, each named as one.

They serve the real wire protocol over real HTTP, so the code under test uses its real client
(``kubernetes``, boto3) unchanged; what they do behind it is a small, documented emulation.
"""
