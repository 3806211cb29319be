"""InspectError: input the inspector cannot show (a file, an endpoint). Its message is
written for the user and shown as is: in the window's banner, or on stderr."""


class InspectError(Exception):
    pass
