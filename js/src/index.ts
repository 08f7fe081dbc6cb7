import {
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ICommandPalette } from '@jupyterlab/apputils';
import { IConsoleTracker } from '@jupyterlab/console';
import { INotebookTracker } from '@jupyterlab/notebook';
import { IRenderMimeRegistry } from '@jupyterlab/rendermime';
import { IStatusBar } from '@jupyterlab/statusbar';
import { Signal } from '@lumino/signaling';
import { Widget } from '@lumino/widgets';

import { hostFor, Hosts, IHost } from './hosts';
import { SIDEBAR_MIME } from './protocol';
import { sidebarRendererFactory } from './renderer';
import { gpumemIcon, SidebarController, wasDocked } from './sidebar';
import { StatusConnection, StatusItem } from './status';

/** Lower than ipywidgets' widget-view renderer (-10): ours is preferred. */
const RENDERER_RANK = -50;

/**
 * How long a restored `%gpumem sidebar` output waits for its kernel's status
 * comm to say whether its panel is still live (a busy kernel answers late).
 */
const LIVE_PANEL_WAIT_MS = 15000;

const CommandIDs = {
  showSidebar: 'gpumem:show-sidebar',
  closeSidebar: 'gpumem:close-sidebar'
} as const;

function activate(
  app: JupyterFrontEnd,
  rendermime: IRenderMimeRegistry,
  notebooks: INotebookTracker | null,
  consoles: IConsoleTracker | null,
  statusBar: IStatusBar | null,
  palette: ICommandPalette | null
): void {
  const hosts = new Hosts(notebooks, consoles);
  const sidebar = new SidebarController(app);
  // One status connection per notebook / console.
  const connections = new Map<Widget, StatusConnection>();
  const factory = sidebarRendererFactory(
    sidebar,
    hosts,
    (host, modelId, take) => {
      const connection = connections.get(host.widget);
      if (!connection) {
        return false;
      }
      return take
        ? connection.takeFreshOutput(modelId)
        : connection.hasFreshOutput(modelId);
    },
    (host, modelId) => {
      const connection = connections.get(host.widget);
      return connection
        ? connection.showsLivePanel(modelId, LIVE_PANEL_WAIT_MS)
        : Promise.resolve(false);
    }
  );

  // Registered globally; documents clone the registry when they open, and
  // the ones opened before this plugin get it explicitly.
  rendermime.addFactory(factory, RENDERER_RANK);
  const ensureFactory = (host: IHost | null) => {
    if (host && !host.rendermime.getFactory(SIDEBAR_MIME)) {
      host.rendermime.addFactory(factory, RENDERER_RANK);
    }
  };

  const activeChanged = new Signal<object, void>(sidebar);
  const track = (widget: Widget) => {
    const host = hostFor(widget);
    if (!host || connections.has(widget)) {
      return;
    }
    ensureFactory(host);
    const connection = new StatusConnection(host);
    connections.set(widget, connection);
    // After a page reload: dock the panel again once the kernel's status comm is back, when this
    // notebook's panel was docked before (asked once per connection).
    let restoreAsked = false;
    connection.changed.connect(() => {
      refresh();
      if (!connection.isConnected) {
        restoreAsked = false;
      } else if (
        !restoreAsked &&
        wasDocked(host) &&
        !sidebar.hasLivePanel(host)
      ) {
        restoreAsked = connection.requestSidebar();
      }
    });
    connection.sidebarAnswered.connect((_, answer) => {
      if (answer.modelId) {
        sidebar.dock(host, answer.modelId);
      } else if (answer.error) {
        sidebar.fail(host, answer.error);
      }
    });
    widget.disposed.connect(() => {
      connection.dispose();
      connections.delete(widget);
      refresh();
    });
  };
  // Close this page's comms when it goes away, so the kernel stops sending to them and
  // stops counting this page's widget views (they are never removed one by one then).
  window.addEventListener('pagehide', () => {
    for (const connection of connections.values()) {
      connection.dispose();
    }
  });
  notebooks?.forEach(track);
  notebooks?.widgetAdded.connect((_, panel) => track(panel));
  consoles?.forEach(track);
  consoles?.widgetAdded.connect((_, panel) => track(panel));

  /** The document the user is working in. */
  const activeHost = (): IHost | null =>
    hostFor(app.shell.currentWidget) ??
    hostFor(notebooks?.currentWidget) ??
    hostFor(consoles?.currentWidget);

  const activeConnection = (): StatusConnection | null => {
    const host = activeHost();
    return host ? (connections.get(host.widget) ?? null) : null;
  };

  /** Open the sidebar for `host`, asking its kernel for a panel if needed. */
  const showFor = (host: IHost | null) => {
    if (!host || sidebar.hasLivePanel(host)) {
      sidebar.show();
      return;
    }
    const connection = connections.get(host.widget);
    if (connection?.requestSidebar()) {
      sidebar.wait(
        host,
        `Waiting for the kernel of ${host.name()}… (a running cell may delay the answer)`
      );
    } else {
      sidebar.show();
    }
  };

  app.commands.addCommand(CommandIDs.showSidebar, {
    label: 'GPU memory: show sidebar',
    caption: 'Show the live GPU memory panel in the right sidebar',
    icon: gpumemIcon,
    execute: () => showFor(activeHost())
  });
  app.commands.addCommand(CommandIDs.closeSidebar, {
    label: 'GPU memory: close sidebar',
    isEnabled: () => sidebar.isOpen,
    execute: () => sidebar.close()
  });
  palette?.addItem({ command: CommandIDs.showSidebar, category: 'GPU memory' });
  palette?.addItem({
    command: CommandIDs.closeSidebar,
    category: 'GPU memory'
  });

  let item: StatusItem | null = null;
  const refresh = () => {
    item?.display(activeConnection());
    activeChanged.emit();
  };
  if (statusBar) {
    item = new StatusItem(() => showFor(activeHost()));
    statusBar.registerStatusItem('gpumem:status', {
      item,
      align: 'left',
      rank: 5,
      isActive: () => activeConnection()?.isConnected === true,
      activeStateChanged: activeChanged
    });
  }
  notebooks?.currentChanged.connect(refresh);
  consoles?.currentChanged.connect(refresh);
  app.shell.currentChanged?.connect(refresh);
  refresh();
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'gpumem:plugin',
  description:
    "Docks the gpumem GPU memory panel in the right sidebar and shows the active kernel's GPU memory in the status bar.",
  autoStart: true,
  requires: [IRenderMimeRegistry],
  optional: [INotebookTracker, IConsoleTracker, IStatusBar, ICommandPalette],
  activate
};

export default plugin;
