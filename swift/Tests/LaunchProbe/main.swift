/// Test support for LifecycleTests: launches two servers, prints their pids, waits to be killed.
import Foundation
import TreegraftKit

do {
    let first = try await TreegraftServer.launch(arguments: ["--no-autotune"])
    let second = try await TreegraftServer.launch(arguments: ["--no-autotune"])
    FileHandle.standardOutput.write(Data("pids \(first.processIdentifier) \(second.processIdentifier)\n".utf8))
    withExtendedLifetime((first, second)) { while true { sleep(60) } }
} catch {
    print("failed \(error)")
    exit(1)
}
