"""Stand-in for cupy.cuda.runtime: one device with a fixed UUID."""
def getDeviceCount(): return 1
def getDeviceProperties(i): return {"uuid": bytes(range(16)), "name": b"fake"}
def deviceGetPCIBusId(i): return "0000:01:00.0"
def runtimeGetVersion(): return 13000
def driverGetVersion(): return 13000
